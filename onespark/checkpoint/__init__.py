"""The checkpoint steps on the host: download (step 0), hybrid (1), mtp (2), verify, the draft vocabulary, and
what they share (writer: the output skeleton and manifest; safetensors_io; lock), plus the generated test
checkpoints (synth, tinymodel). Never torch or vllm: surgery moves bytes (tests/test_wings.py)."""
