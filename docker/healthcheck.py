"""Docker HEALTHCHECK of the onespark v2 image: GET /health on the port vLLM listens on.

The entrypoint's default is 127.0.0.1:8000; ONESPARK_HEALTH_URL overrides it (`docker run -e`) when the user
moves vLLM with --host/--port. Exit 0 healthy, 1 not (Docker's contract). Standard library only.
"""

import os
import sys
import urllib.request

url = os.environ.get("ONESPARK_HEALTH_URL", "http://127.0.0.1:8000/health")
try:
    with urllib.request.urlopen(url, timeout=5) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception as e:  # any failure is "unhealthy"; the reason goes to `docker inspect` .State.Health
    print(f"{url}: {e}", file=sys.stderr)
    sys.exit(1)
