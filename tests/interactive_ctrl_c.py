"""llmq-run's interactive mode with the real tools: Ctrl-C (SIGINT) stops the current reply, not
the program; the next line gets a reply; /reset works; end of input exits 0 with the stats line.
Uses SmolLM2 (its story replies run long enough to interrupt); skips (exit 0, 'SKIPPED') without it.

usage: interactive_ctrl_c.py BIN_DIR MODELS_DIR
"""
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile
import time

bin_dir, models = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
gguf = models / "smollm2-135m-instruct-q4_1.gguf"
if not gguf.exists():
    print(f"SKIPPED: {gguf} not found (scripts/fetch_models.sh fetches it)")
    sys.exit(0)
with tempfile.TemporaryDirectory() as tmp:
    model = pathlib.Path(tmp) / "smol.llmq"
    subprocess.run([bin_dir / "llmq-convert", gguf, "-o", model, "--no-progress"], check=True, capture_output=True)
    p = subprocess.Popen([bin_dir / "llmq-run", "-m", model, "-n", "400", "--temp", "0.7", "--seed", "1", "-t", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdin.write(b"Write a very long story about a dragon.\n")
    p.stdin.flush()
    # Ctrl-C as soon as the reply has begun: decoding runs at hundreds of tokens per second, so
    # a fixed delay could land after the reply has ended (at the prompt, Ctrl-C exits).
    first = b""
    deadline = time.monotonic() + 120
    while not first and time.monotonic() < deadline:
        if select.select([p.stdout], [], [], 1.0)[0]:
            first = os.read(p.stdout.fileno(), 1 << 16)
    assert first, "no reply within 120 s"
    p.send_signal(signal.SIGINT)  # stops the reply, not the program
    time.sleep(0.5)
    assert p.poll() is None, "llmq-run exited on Ctrl-C during a reply"
    p.stdin.write(b"/reset\nSay hi in one word.\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=300)
    out, err = (first + out).decode(errors="replace"), err.decode(errors="replace")
    assert p.returncode == 0, f"exit code {p.returncode}: {err}"
    assert "(stopped)" in err, err
    assert "(conversation reset)" in err, err
    assert "generated" in err and "tok/s decode" in err, err
    replies = [line for line in out.splitlines() if line.strip()]
    assert len(replies) >= 2, out
print("1 passed, 0 failed")
