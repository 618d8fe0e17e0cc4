"""llmq-server for the bench scripts: started on a free port, used, stopped.

    from llmq_server import llmq_server
    with llmq_server(model, "-t", "2", "--parallel", "8") as (proc, base):
        ...  # base is "http://127.0.0.1:PORT"; proc.pid for /proc

Only python3's standard library. The server's stderr is dropped; its binary is build/llmq-server.
"""
import contextlib
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def llmq_server(model, *args, timeout_s=120):
    """Starts build/llmq-server -m MODEL --port FREE ARGS, waits until /health answers 200
    (RuntimeError after timeout_s), yields (process, base URL) and stops it with SIGTERM."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(ROOT / "build/llmq-server"), "-m", str(model), "--port", str(port), *map(str, args)],
                            stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                if urllib.request.urlopen(base + "/health").status == 200:
                    break
            except Exception:  # not listening yet, or 503 while loading
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"llmq-server did not come up on {base}")
                time.sleep(0.5)
        yield proc, base
    finally:
        proc.terminate()
        proc.wait()
