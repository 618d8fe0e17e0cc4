"""Fixtures for the llmq-server tests: real models converted by the real llmq-convert, the real
llmq-server binary started on 127.0.0.1 on a free port, stopped with SIGTERM at the end and
checked to have exited cleanly (exit code 0, no crash, no sanitizer report).

Environment (tests/CMakeLists.txt sets them; run.sh defaults them):
  LLMQ_BIN_DIR     folder with llmq-server and llmq-convert
  LLMQ_SHARED_DIR  the shared data folder (models/stories260K)
  LLMQ_MODELS_DIR  the repository's models/ (smollm2-135m-instruct-q4_1.gguf)
  BUILD_DIR        where artifacts go (tests/web-chat.png)
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("LLMQ_BIN_DIR", REPO / "build"))
SHARED_DIR = Path(os.environ.get("LLMQ_SHARED_DIR", REPO.parent / "shared"))
MODELS_DIR = Path(os.environ.get("LLMQ_MODELS_DIR", REPO / "models"))
BUILD_DIR = Path(os.environ.get("BUILD_DIR", BIN_DIR))

sys.path.insert(0, str(REPO / "bench"))
import server_load  # noqa: E402  (bench/server_load.py: the load measurement, shared with test_load.py)

STORIES_BIN = SHARED_DIR / "models" / "stories260K" / "stories260K.bin"
STORIES_TOK = SHARED_DIR / "models" / "stories260K" / "tok512.bin"
SMOL_GGUF = MODELS_DIR / "smollm2-135m-instruct-q4_1.gguf"
QWEN_GGUF = MODELS_DIR / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"

# Texts that each name one contact (name, email, role), for the extraction tests
# (test_structured.py, test_clients.py).
CONTACT_TEXTS = ["Ana Lima is an engineer, reach her at ana@example.com.",
                 "Contact: Bob Stone (manager) - bob.stone@corp.test",
                 "Our designer Chen Wei can be emailed at chen@studio.example.",
                 "Write to dara@example.org; Dara Okafor leads the team as manager.",
                 "Eve (eve@lab.test) works as an engineer in the lab.",
                 "Farid Haddad, designer, farid.h@example.net",
                 "Gita Rao <gita@example.com> is the office manager.",
                 "Hugo Martin handles support; email hugo@example.fr.",
                 "Ines Costa sells our plans: ines.costa@example.pt",
                 "For hiring questions ask Jon Park at jon.park@example.kr, he is a manager."]

# What a crashed or sanitized run leaves in its log.
CRASH_MARKERS = ("AddressSanitizer", "LeakSanitizer", "UndefinedBehaviorSanitizer", "runtime error:",
                 "terminate called", "Segmentation fault", "Aborted", "core dumped")


def binary(name: str) -> Path:
    p = BIN_DIR / name
    if not p.is_file():
        pytest.fail(f"{p} not found: build it (cmake --build BUILD --target {name}) or set LLMQ_BIN_DIR")
    return p


def run_convert(args: list, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary("llmq-convert")), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


# ---------------------------------------------------------------- models

@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def stories_model(models_dir) -> Path:
    """stories260K converted to Q8_0 by llmq-convert (no chat template: servers add --chat-template)."""
    if not STORIES_BIN.is_file() or not STORIES_TOK.is_file():
        pytest.skip(f"stories260K is not in {STORIES_BIN.parent} (set LLMQ_SHARED_DIR)")
    out = models_dir / "stories260K-q8_0.llmq"
    r = run_convert([STORIES_BIN, "--tokenizer", STORIES_TOK, "--type", "q8_0", "-o", out])
    assert r.returncode == 0, f"llmq-convert failed ({r.returncode}):\n{r.stderr[-2000:]}"
    return out


def converted_gguf(models_dir: Path, gguf: Path, name: str) -> Path:
    """A real GGUF from models/ converted by llmq-convert (a lossless repack); skips when missing."""
    if not gguf.is_file():
        pytest.skip(f"{gguf} is missing: run scripts/fetch_models.sh all")
    out = models_dir / f"{name}.llmq"
    r = run_convert([gguf, "-o", out])
    assert r.returncode == 0, f"llmq-convert failed ({r.returncode}):\n{(r.stderr or r.stdout)[-2000:]}"
    return out


@pytest.fixture(scope="session")
def smol_model(models_dir) -> Path:
    """SmolLM2-135M-Instruct (the real chat model) converted from its GGUF."""
    return converted_gguf(models_dir, SMOL_GGUF, "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen_model(models_dir) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M (its chat template renders tools)."""
    return converted_gguf(models_dir, QWEN_GGUF, "qwen2.5-coder-0.5b-instruct")


# ---------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def client(srv):
    """An openai.OpenAI client of the module's `srv` fixture (each test module starts its own server)."""
    with srv.client() as c:
        yield c


class LlmqServer:
    """One llmq-server process on 127.0.0.1:<free port>."""

    def __init__(self, model: Path, args: list, log_dir: Path, api_key: str | None = None, launcher: list | None = None):
        self.model = Path(model)
        self.launcher = [str(a) for a in (launcher or [])]  # e.g. ["mpirun", "-np", "2"]: what runs llmq-server
        self.args = [str(a) for a in args]
        self.api_key = api_key
        self.model_id = self.model.stem
        self.log_path = log_dir / f"llmq-server-{self.model_id}-{os.getpid()}-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.returncode: int | None = None
        self.stop_seconds = 0.0  # from SIGTERM to exit

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, wait: bool = True) -> "LlmqServer":
        for _ in range(3):  # a free port can be taken between asking and binding: try another
            self.port = server_load.free_port()
            cmd = [*self.launcher, str(binary("llmq-server")), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                   *self.args]
            if self.api_key:
                cmd += ["--api-key", self.api_key]
            self.log = open(self.log_path, "w")
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if not wait:
                return self
            try:
                self.wait_ready()
                return self
            except RuntimeError:
                self.log.close()
                if "cannot listen" in self.log_text():
                    continue
                raise
        raise RuntimeError(f"llmq-server could not bind a port:\n{self.log_text()}")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llmq-server exited with {self.proc.returncode} while starting:\n{self.log_text()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"llmq-server: /health not 200 after {timeout} s:\n{self.log_text()}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        import openai
        kw.setdefault("api_key", self.api_key or "no-key")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.base_url, **kw)

    def post(self, path: str, body=None, **kw) -> requests.Response:
        kw.setdefault("timeout", 120)
        headers = {**self.headers(), **kw.pop("headers", {})}
        return requests.post(self.url + path, json=body, headers=headers, **kw)

    def get(self, path: str, **kw) -> requests.Response:
        kw.setdefault("timeout", 30)
        headers = {**self.headers(), **kw.pop("headers", {})}
        return requests.get(self.url + path, headers=headers, **kw)

    def metrics(self) -> "Metrics":
        r = self.get("/metrics")
        assert r.status_code == 200, r.text
        assert r.headers["Content-Type"].startswith("text/plain"), r.headers
        return Metrics.parse(r.text)

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        r = self.post("/tokenize", {"content": text, "add_special": add_special})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    def wait_idle(self, timeout: float = 10.0) -> "Metrics":
        """Waits until no sequence runs and none waits; returns the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m.value("llmq_running_sequences") == 0 and m.value("llmq_queue_length") == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server is not idle after {timeout} s: running "
                                     f"{m.value('llmq_running_sequences')}, queued {m.value('llmq_queue_length')}")
            time.sleep(0.02)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then waits; returns the exit code (negative: killed by a signal)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            t0 = time.monotonic()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
                self.stop_seconds = time.monotonic() - t0
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.log.close()
                raise AssertionError(f"llmq-server did not exit within {timeout} s of SIGTERM:\n{self.log_text()[-3000:]}")
        self.log.close()
        self.returncode = self.proc.returncode
        return self.returncode

    def check_clean_exit(self, rc: int) -> None:
        log = self.log_text()
        assert rc == 0, f"llmq-server exited with {rc} (expected 0 after SIGTERM):\n{log[-3000:]}"
        bad = [m for m in CRASH_MARKERS if m in log]
        assert not bad, f"llmq-server's log shows {bad}:\n{log[-3000:]}"


class Servers:
    """Starts servers and, at teardown, stops each with SIGTERM and checks its exit."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.started: list[LlmqServer] = []

    def start(self, model: Path, *args, api_key: str | None = None, wait: bool = True, launcher: list | None = None) -> LlmqServer:
        s = LlmqServer(model, list(args), self.log_dir, api_key, launcher)
        self.started.append(s)
        return s.start(wait)

    def stop_all(self) -> None:
        errors = []
        for s in self.started:
            try:
                s.check_clean_exit(s.stop())
            except AssertionError as e:
                errors.append(str(e))
        self.started.clear()
        if errors:
            pytest.fail("\n\n".join(errors), pytrace=False)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Module-scoped: servers shared by the tests of one file."""
    s = Servers(tmp_path_factory.mktemp("server-logs"))
    yield s
    s.stop_all()


@pytest.fixture
def fresh_servers(tmp_path_factory):
    """Function-scoped: servers of one test."""
    s = Servers(tmp_path_factory.mktemp("server-logs"))
    yield s
    s.stop_all()


# ---------------------------------------------------------------- Prometheus text

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)(\s+-?\d+)?$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')


class Metrics:
    """A parsed Prometheus text exposition (format 0.0.4), validated while parsing."""

    def __init__(self):
        self.types: dict[str, str] = {}
        self.helps: dict[str, str] = {}
        self.samples: list[tuple[str, dict, float]] = []

    @classmethod
    def parse(cls, text: str) -> "Metrics":
        m = cls()
        assert text.endswith("\n"), "the exposition must end with a newline"
        for n, line in enumerate(text.split("\n")[:-1], 1):
            if not line.strip():
                continue
            if line.startswith("# HELP "):
                name, _, help_ = line[7:].partition(" ")
                m.helps[name] = help_
            elif line.startswith("# TYPE "):
                name, _, typ = line[7:].partition(" ")
                assert typ in ("counter", "gauge", "histogram", "summary", "untyped"), f"line {n}: type {typ!r}"
                assert name not in m.types, f"line {n}: {name} typed twice"
                m.types[name] = typ
            elif line.startswith("#"):
                continue
            else:
                g = _SAMPLE.match(line)
                assert g, f"line {n} is not a sample: {line!r}"
                labels = {}
                if g.group(3):
                    rest = g.group(3)
                    while rest.strip():
                        lm = _LABEL.match(rest)
                        assert lm, f"line {n}: bad labels {g.group(3)!r}"
                        labels[lm.group(1)] = lm.group(2)
                        rest = rest[lm.end():]
                value = float(g.group(4))  # accepts +Inf, NaN
                m.samples.append((g.group(1), labels, value))
        for name, labels, _ in m.samples:
            family = m.family(name)
            assert family in m.types, f"sample {name} has no # TYPE"
        for fam, typ in m.types.items():
            if typ == "histogram":
                m._check_histogram(fam)
        return m

    def family(self, name: str) -> str:
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and self.types.get(name[: -len(suffix)]) == "histogram":
                return name[: -len(suffix)]
        return name

    def _check_histogram(self, fam: str) -> None:
        buckets = [(lab["le"], v) for n, lab, v in self.samples if n == fam + "_bucket"]
        assert buckets and buckets[-1][0] == "+Inf", f"{fam}: no +Inf bucket"
        les = [float(le) for le, _ in buckets]
        assert les == sorted(les), f"{fam}: bucket bounds not increasing"
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), f"{fam}: bucket counts not cumulative"
        assert self.value(fam + "_count") == counts[-1], f"{fam}: _count != +Inf bucket"

    def value(self, name: str, **labels) -> float:
        """The sample's value; 0 when absent (a counter not yet incremented)."""
        for n, lab, v in self.samples:
            if n == name and all(lab.get(k) == str(x) for k, x in labels.items()):
                return v
        if name not in self.types and self.family(name) not in self.types:
            raise KeyError(f"no metric {name} in the exposition")
        return 0.0
