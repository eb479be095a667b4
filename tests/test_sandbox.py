"""Code rewards: the sandbox (delta_jax.rl.sandbox), RewardScorer(name="code"), code_reward, and
the SandboxFusion client against a local stand-in server.

Hostile programs run only where the host can isolate (the reason is in the skip message
otherwise); the refusal without isolation and the explicit opt-out are tested on every host.
"""
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from delta_jax.rl import rewards as R
from delta_jax.rl import sandbox as sb
from delta_jax.rl import verify_pool as vp
from tests.rl_fixtures import python_path

TIMEOUT_S = 3.0


def _probe():
    with vp.VerifyPool(R._SANDBOX_FN, num_workers=1, timeout_s=60) as pool:
        out = pool.map([({"op": "probe"},)])[0]
    return out.value["ok"], out.value["why"]


ISOLATION_OK, ISOLATION_WHY = _probe()
needs_isolation = pytest.mark.skipif(
    not ISOLATION_OK, reason=f"this host cannot isolate programs: {ISOLATION_WHY}")


@pytest.fixture(scope="module")
def scorer():
    if not ISOLATION_OK:
        pytest.skip(f"this host cannot isolate programs: {ISOLATION_WHY}")
    with R.RewardScorer("code", num_workers=2, timeout_s=TIMEOUT_S) as s:
        yield s


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\nDone."


# --- programs and specs --------------------------------------------------------------------


def test_extract_program():
    assert sb.extract_program("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```\n") == "y = 2\n"
    assert sb.extract_program("```\nz = 3\n```") == "z = 3\n"
    assert sb.extract_program("```python\n    return 1\n```") == "    return 1\n"  # indented
    assert sb.extract_program("print(1)") == "print(1)"
    assert sb.extract_program("```text\nno\n```\n```python\nyes\n```\n```\nbare\n```") == "yes\n"


def test_parse_spec_layouts_and_errors():
    assert sb.parse_spec({"prompt": "", "entry_point": "f", "test": ""})["kind"] == "function"
    assert sb.is_spec('{"tests": ["assert True"]}') and not sb.is_spec("{1, 2}")
    assert not sb.is_spec("42") and not sb.is_spec({"tests": []})
    assert sb.parse_spec('{"inputs": ["1"], "outputs": ["1"]}')["kind"] == "stdio"
    assert sb.parse_spec({"inputs": [[1]], "outputs": [1], "fn_name": "f"})["kind"] == "call"
    assert sb.parse_spec({"tests": ["assert 1"]})["kind"] == "assert"
    with pytest.raises(sb.SpecError, match=r"keys \['answer'\]"):
        sb.parse_spec({"answer": "3"})
    with pytest.raises(sb.SpecError, match="equal length"):
        sb.parse_spec({"inputs": ["1"], "outputs": []})
    with pytest.raises(sb.SpecError, match="not JSON"):
        sb.parse_spec("{nope")


def test_outputs_match():
    assert sb.outputs_match("1 2  \n3\n\n", "1 2\n3")
    assert not sb.outputs_match("1 2\n", "1  2\n")
    assert sb.call_result_matches((1, 2), [[1, 2]]) and sb.call_result_matches([1], [1])


def test_limits_are_checked():
    with pytest.raises(ValueError, match="memory_mb"):
        sb.Limits(memory_mb=0)


# --- scoring (isolated) --------------------------------------------------------------------

ADD_STDIO = {"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7", "0\n"]}


def test_spec_kinds_and_pass_fraction(scorer):
    responses = [
        fenced("a, b = map(int, input().split())\nprint(a + b)\n"),
        fenced("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n"),
        fenced("def f(x):\n    return x * 2\n"),
        fenced("class Solution:\n    def add(self, a, b):\n        return a + b\n"),
        "def f(x): return x * 2",  # no fence: the whole response is the program
        fenced("import sys\nprint(3)\nsys.exit(0)\n"),  # exiting with 0 is fine for stdio
    ]
    golds = [ADD_STDIO, ADD_STDIO,
             json.dumps({"tests": ["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 7"]}),
             {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], 7]},
             {"tests": ["assert f(4) == 8"]},
             {"inputs": ["\n"], "outputs": ["3"]}]
    rewards, info = scorer.score(responses, golds)
    assert rewards.dtype == np.float32
    np.testing.assert_array_equal(rewards, [1, 0, 0, 1, 1, 1])
    assert info["num_no_box"] == 1 and info["num_timeouts"] == 0 and info["num_errors"] == 0
    assert info["tests_passed"].tolist()[:3] == [3, 1, 2]  # stops at the first failure
    with R.RewardScorer("code", num_workers=1, timeout_s=TIMEOUT_S, pass_fraction=True) as frac:
        rewards, _ = frac.score(responses[1:3], golds[1:3])
    np.testing.assert_allclose(rewards, [2 / 3, 2 / 3], rtol=1e-6)


def test_exiting_early_does_not_pass(scorer):
    spec = {"prompt": "def f(x):\n", "entry_point": "f",
            "test": "def check(c):\n    assert c(1) == 5\n"}
    responses = [fenced("import os\nos._exit(0)\n"), fenced("import sys\nsys.exit(0)\n"),
                 fenced("raise SystemExit\n"), fenced("def f(x):\n    return 5\n")]
    rewards, _ = scorer.score(responses, [spec] * 4)
    np.testing.assert_array_equal(rewards, [0, 0, 0, 1])


def test_verdicts_cached_timeouts_not(scorer):
    loop = fenced("while True:\n    pass\n")
    good = fenced("def f(x):\n    return x\n")
    golds = [{"tests": ["assert f(2) == 2"]}] * 2
    _, info = scorer.score([loop, good], golds)
    assert info["timed_out"].tolist() == [True, False] and info["cache_hits"] == 0
    _, info = scorer.score([loop, good], golds)
    assert info["timed_out"].tolist() == [True, False]
    assert info["cache_hits"] == 1 and info["num_programs_run"] == 1
    # The same hostile program 8 times in a batch runs once.
    _, info = scorer.score([loop] * 8, golds[:1] * 8)
    assert info["num_timeouts"] == 8 and info["num_programs_run"] == 1


def test_humaneval_canonical_pass_and_stub_fail(scorer, shared_dir):
    path = shared_dir / "data" / "humaneval.jsonl"
    if not path.is_file():
        pytest.skip("humaneval.jsonl is not present in ../shared/data")
    rows = [json.loads(line) for line in path.open(encoding="utf-8")]
    assert len(rows) == 164
    specs = [{k: r[k] for k in ("prompt", "entry_point", "test")} for r in rows]
    good = [fenced(r["canonical_solution"]) for r in rows]
    stub = [fenced("    pass\n") for _ in rows]
    rewards, info = scorer.score(good + stub, specs + specs)
    failed = [rows[i]["id"] for i in range(164) if rewards[i] != 1.0]
    assert failed == [], failed
    assert rewards[164:].tolist() == [0.0] * 164
    assert info["num_timeouts"] == 0 and info["num_errors"] == 0


# --- hostile programs ----------------------------------------------------------------------


def _host_processes():
    """(pid, start time) of the processes that can belong to this test's programs: our own
    descendants (a sandboxed program and anything it forks stay in its pid namespace, setsid or
    not, under our launcher), orphans adopted by init (a daemon that got out of an unisolated
    run) and the trees of orphaned pid namespaces. Unrelated processes that others start on the
    host meanwhile (a shell and its children, the reward pools of another pytest worker, whose
    ancestry reaches init only through our shared ancestors) are not counted."""
    own_ns, me = os.readlink("/proc/self/ns/pid"), os.getpid()
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().split(")")[-1].split()
                ns = os.readlink(f"/proc/{entry}/ns/pid")
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), fields[19], ns)  # (ppid, start, pid namespace)

    def ours(pid):
        start, seen = pid, set()
        while pid in stats and pid not in seen:
            seen.add(pid)
            ppid, _, ns = stats[pid]
            if ppid == me:
                return True
            if ppid == 1:  # an orphan: a sandbox's pid namespace or a daemon that got out;
                return ns != own_ns or pid == start  # not a process of another test worker
            pid = ppid
        return False

    return {(pid, start) for pid, (_, start, _) in stats.items() if pid != me and ours(pid)}


def _describe(pid):
    """A leftover process's command line, state and parent, for the failure message."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().split(")")[-1].split()
        return f"{cmd or '?'} (state {fields[0]}, ppid {fields[1]})"
    except OSError:
        return "gone"


def _score_one(scorer, program, tests=("assert True",)):
    t0 = time.perf_counter()
    rewards, info = scorer.score([fenced(program)], [{"tests": list(tests)}])
    return float(rewards[0]), info, time.perf_counter() - t0


@needs_isolation
@pytest.mark.parametrize("name, program, times_out", [
    ("infinite loop", "while True:\n    pass\n", True),
    # RLIMIT_AS: a MemoryError, a failed program (no timeout, no crash, no sandbox error)
    ("16 GB allocation", "x = bytearray(16 << 30)\nx[::4096] = b'1' * len(x[::4096])\n", False),
    ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n"
                  "    except OSError:\n        pass\n", True),
    ("daemon that escapes its session",
     "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
     "time.sleep(60)\n", True),
])
def test_hostile_program_scores_zero_and_leaves_nothing(scorer, name, program, times_out):
    """Each hostile program gets its verdict (a timeout, or a failure of its own for the memory
    hog) from the sandbox itself: the pool's backstop (timeout_s + 15 s, a worker replaced) is
    never needed; and no process of it is left on the host."""
    before = _host_processes()
    backstops = scorer.pool.stats["timeouts"]
    reward, info, _ = _score_one(scorer, program)
    assert reward == 0.0, name
    assert info["num_programs_run"] == 1 and info["tests_passed"].tolist() == [0], (name, info)
    assert info["timed_out"].tolist() == [times_out], (name, info)
    assert info["errored"].tolist() == [False] and info["num_crashes"] == 0, (name, info)
    assert scorer.pool.stats["timeouts"] == backstops, name  # not killed by the backstop
    # The namespace is torn down by the kernel; on a loaded machine that can take a moment. A
    # process that escaped would still be there (a fork bomb or daemon runs on): poll for 5 s.
    give_up = time.monotonic() + 5.0
    while True:
        time.sleep(0.2)
        leftover = _host_processes() - before
        if not leftover or time.monotonic() > give_up:
            break
    assert not leftover, (name, {pid: _describe(pid) for pid, _ in leftover})


@needs_isolation
def test_no_network_the_server_sees_no_connection(scorer):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    program = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
               "s.sendall(b'hello')\n")
    try:
        reward, info, _ = _score_one(scorer, program)
        assert reward == 0.0
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


@needs_isolation
def test_writes_outside_the_working_directory_do_not_reach_the_host(scorer, tmp_path):
    target = f"/tmp/delta_jax_sandbox_escape_{os.getpid()}"
    home_target = tmp_path / "written.txt"
    program = (
        "import ctypes, os\n"
        "ctypes.CDLL(None).umount2(b'/tmp', 2)  # no capabilities: fails\n"
        f"open({target!r}, 'w').write('x')\n"
        f"try:\n    open({str(home_target)!r}, 'w').write('x')\nexcept OSError:\n    pass\n"
        "open('local.txt', 'w').write('x')\n"
        "assert os.path.exists('/tmp/work/local.txt') or os.path.exists('local.txt')\n")
    reward, info, _ = _score_one(scorer, program, tests=["assert False"])
    assert reward == 0.0 and info["num_errors"] == 0
    assert not os.path.exists(target) and not home_target.exists()
    # The same program passes a passing test: the writes inside the sandbox worked.
    reward, _, _ = _score_one(scorer, program)
    assert reward == 1.0
    assert not os.path.exists(target)


# --- no isolation: refusal and opt-out -----------------------------------------------------

REFUSAL_SCRIPT = """
import json, warnings
from delta_jax.rl.rewards import IsolationUnavailable, RewardScorer
try:
    RewardScorer("code", num_workers=1)
    print("started")
except IsolationUnavailable as e:
    print("refused:", e)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with RewardScorer("code", num_workers=1, timeout_s=2.0, code_isolation=False) as s:
        r, info = s.score(["```python\\ndef f(x): return x\\n```", "while True: pass"],
                          [{"tests": ["assert f(3) == 3"]}] * 2)
print("opt-out:", r.tolist(), info["num_timeouts"], [str(w.message)[:40] for w in caught])
"""


def test_without_user_namespaces_the_scorer_refuses_unless_opted_out(tmp_path):
    """Runs a script where creating user namespaces is impossible: inside a user namespace whose
    max_user_namespaces is 0 (or directly, when this host cannot create them at all)."""
    env = dict(os.environ, PYTHONPATH=python_path())
    script = tmp_path / "refuse.py"
    script.write_text(REFUSAL_SCRIPT)
    if ISOLATION_OK:
        if not shutil.which("unshare"):
            pytest.skip("no `unshare` binary to build a host without user namespaces")
        cmd = ["unshare", "-Ur", "sh", "-c",
               f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} {script}"]
    else:
        cmd = [sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("refused: rewards.code_isolation: this host cannot isolate"), lines
    assert "--config.rewards.code_isolation=False" in lines[0]
    assert lines[1].startswith("opt-out: [1.0, 0.0] 1 ['rewards.code_isolation=False: model-w"), (
        lines, proc.stderr[-2000:])


def test_opt_out_still_limits_and_cleans_up(monkeypatch):
    # The scratch directories go to a temporary directory of this test's own (the verify workers
    # inherit TMPDIR), so other tests running beside it (pytest-xdist workers) cannot add to or
    # take from what is compared below. Made in the system's temporary directory and open to
    # traversal (0711): run as root, the sandbox drops the program to nobody, who could not reach
    # a scratch directory under pytest's private (0700) tmp_path.
    import tempfile
    private = tempfile.mkdtemp(prefix="test_opt_out_")
    os.chmod(private, 0o711)
    monkeypatch.setenv("TMPDIR", private)
    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.warns(RuntimeWarning, match="WITHOUT namespaces"):
        s = R.RewardScorer("code", num_workers=1, timeout_s=2.0, code_isolation=False)
    try:
        assert tempfile_dir() == private
        before = set(os.listdir(tempfile_dir()))
        rewards, info = s.score([fenced("while True:\n    pass\n"),
                                 fenced("x = bytearray(16 << 30)\n"),
                                 fenced("open('scratch.txt', 'w').write('x')\n")],
                                [{"tests": ["assert True"]}] * 3)
        np.testing.assert_array_equal(rewards, [0, 0, 1])
        assert info["timed_out"].tolist() == [True, False, False]
        assert s.pool.stats["timeouts"] == 0  # the limits stopped the loop, not the backstop
        assert set(os.listdir(tempfile_dir())) == before  # scratch directories removed
    finally:
        s.close()
        shutil.rmtree(private, ignore_errors=True)


def tempfile_dir():
    import tempfile
    return tempfile.gettempdir()


# --- one-off API from a plain script and threads -------------------------------------------

PLAIN_SCRIPT = """
import threading
from delta_jax.rl.rewards import code_reward
spec = {"tests": ["assert add(2, 3) == 5"]}
print("one-off", code_reward("```python\\ndef add(a, b):\\n    return a + b\\n```", spec))
out = {}
def work(i):
    out[i] = code_reward("```python\\ndef add(a, b):\\n    return a - b\\n```", spec)
threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
[t.start() for t in threads]
[t.join() for t in threads]
print("threads", sorted(out.values()))
"""


@needs_isolation
def test_code_reward_from_a_plain_script_and_threads(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=python_path()),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["one-off 1.0", "threads [0.0, 0.0, 0.0]"], proc.stderr


# --- SandboxFusion client against a local stand-in ---------------------------------------


class _StandIn(http.server.BaseHTTPRequestHandler):
    """POST /run_code as SandboxFusion answers it; runs the (trusted, test-made) code with the
    interpreter. Counts requests; answers at most `limit` of them."""
    count = 0
    limit = 64

    def do_POST(self):  # noqa: N802
        type(self).count += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/run_code" or type(self).count > type(self).limit:
            self.send_response(404)
            self.end_headers()
            return
        try:
            proc = subprocess.run([sys.executable, "-c", body["code"]], input=body["stdin"],
                                  capture_output=True, text=True, timeout=body["run_timeout"])
            run = {"status": "Finished", "return_code": proc.returncode, "stdout": proc.stdout,
                   "stderr": proc.stderr[-500:], "execution_time": 0.0}
        except subprocess.TimeoutExpired:
            run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": "",
                   "stderr": "", "execution_time": body["run_timeout"]}
        answer = {"status": "Success" if run["return_code"] == 0 else "Failed", "message": "",
                  "compile_result": None, "run_result": run, "files": {}}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_sandbox_fusion_client_against_a_stand_in_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _StandIn.count = 0
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with R.RewardScorer("code", num_workers=4, timeout_s=2.0, code_sandbox="sandbox_fusion",
                            code_sandbox_url=url) as s:
            responses = [fenced("a, b = map(int, input().split())\nprint(a + b)\n"),
                         fenced("def f(x):\n    return x * 2\n"),
                         fenced("import os\nos._exit(0)\n"),
                         fenced("while True:\n    pass\n"),
                         fenced("    return 1\n"),
                         fenced("class Solution:\n    def g(self, a):\n        return [a, a]\n")]
            golds = [ADD_STDIO, {"tests": ["assert f(2) == 4", "assert f(3) == 6"]},
                     {"tests": ["assert True"]}, {"tests": ["assert True"]},
                     {"prompt": "def one():\n", "entry_point": "one",
                      "test": "def check(c):\n    assert c() == 1\n"},
                     {"fn_name": "g", "inputs": [[1]], "outputs": [[[1, 1]]]}]
            rewards, info = s.score(responses, golds)
        np.testing.assert_array_equal(rewards, [1, 1, 0, 0, 1, 1])
        assert info["num_timeouts"] == 1
        assert _StandIn.count == 3 + 2 + 1 + 1 + 1 + 1  # one request per test script, bounded
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ValueError, match="rewards.code_sandbox_url"):
        R.RewardScorer("code", code_sandbox="sandbox_fusion", code_sandbox_url="")
    with pytest.raises(ValueError, match="rewards.code_sandbox"):
        R.RewardScorer("code", code_sandbox="docker")
