class UserError(Exception):
    """A problem the user can fix. The CLI prints it as one line on stderr and exits 1.

    The message says what is wrong and what to do, e.g.
    "shard model-00003-of-00014.safetensors is truncated (4.1 GB of 5.0 GB): re-run `onespark download`".
    """
