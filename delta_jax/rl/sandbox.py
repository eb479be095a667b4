"""Running untrusted, model-written Python programs against unit tests, in a Linux sandbox.

This module imports only the standard library: it runs inside VerifyPool workers (fresh,
single-threaded interpreters), which fork one sandbox per program. Never call `run_program` in
a process that holds JAX/XLA threads; go through `RewardScorer(name="code")` (rl/rewards.py).

One program, with all of its tests:

    worker W     makes a result pipe, forks S; reads the verdict (JSON) with a deadline; kills
                 S's process group if S overruns; removes the working directory (no isolation)
    └ S          setsid; as root, drops to uid/gid 65534 (root ignores RLIMIT_NPROC); unshares
      │          user, mount, network, IPC, UTS and pid namespaces; maps its one uid; makes /
      │          private and read-only (recursively), mounts fresh size-limited tmpfs on /tmp,
      │          /var/tmp, /dev/shm and /run; forks P, kills it at the wall-clock deadline
      └ P        pid 1 of the new pid namespace (when it exits, the kernel kills every process
        │        left in it: the whole tree, daemons included); a fresh /proc; working directory
        │        /tmp/work; rlimits (address space, CPU seconds, processes, file size, open
        │        files, no core); every capability dropped, no_new_privs; environment scrubbed;
        │        runs the tests and writes the verdict to W
        └ T      one per test (stdin/stdout tests) or one per program (function / assert tests):
                 runs the program; reports to P over its own pipe

What a program can do: read the host's files (the filesystem is read-only, the tmpfs are empty
and vanish with the namespace), compute until the CPU or wall limit, allocate up to the address
space limit per process, start up to `max_processes` processes/threads. What it cannot: reach any
network (a new network namespace has only a loopback device, down), write outside its tmpfs,
signal or see host processes, outlive its deadline, keep capabilities.

Without user namespaces (some container runtimes forbid them) `check_isolation()` says why, and
the code scorer refuses to start unless isolation is explicitly switched off (`isolate=False`):
then programs run with the rlimits, a fresh working directory (deleted after) and the process
group kill only, which does not stop a program that writes elsewhere, uses the network or
escapes its session.

Specs (`parse_spec`), the test layouts of common code data sets:

    {"prompt", "entry_point", "test"}    HumanEval: prompt (unless the program defines the entry
                                         point) + program; then test; then check(entry_point)
    {"inputs": [...], "outputs": [...]}  stdin/stdout (APPS / TACO / CodeContests): the program
                                         reads stdin; outputs compared after stripping trailing
                                         whitespace per line and trailing blank lines
    {"fn_name", "inputs", "outputs"}     call-based (APPS / TACO LeetCode style): fn(*inputs[i])
                                         == outputs[i] (a class Solution method is also found)
    {"tests": [...], ["setup": str]}     assert lists (MBPP): each test is a statement
"""
from __future__ import annotations

import ast
import builtins
import ctypes
import dataclasses
import errno
import io
import json
import os
import re
import resource
import secrets
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Mapping

OK, TIMEOUT, CRASH, ERROR = "ok", "timeout", "crash", "error"

# ---------------------------------------------------------------------------------------------
# Limits and specs
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one program run (all of its tests).

    timeout_s: wall-clock seconds for the program with all of its tests.
    cpu_s: CPU seconds per process (0: the wall limit rounded up, + 1).
    memory_mb: address space per process (RLIMIT_AS).
    max_processes: processes + threads in the sandbox (RLIMIT_NPROC in its user namespace).
    file_mb: largest file (and captured output) a program may write (RLIMIT_FSIZE).
    tmpfs_mb: size of each tmpfs (the working directory lives on /tmp).
    """
    timeout_s: float = 10.0
    cpu_s: float = 0.0
    memory_mb: int = 1024
    max_processes: int = 16
    file_mb: int = 16
    tmpfs_mb: int = 64

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "max_processes", "file_mb", "tmpfs_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")
        if self.cpu_s < 0:
            raise ValueError(f"sandbox limit cpu_s must be >= 0, got {self.cpu_s}")

    @property
    def cpu_seconds(self) -> int:
        return int(self.cpu_s) if self.cpu_s > 0 else int(self.timeout_s) + 2


class SpecError(ValueError):
    """A test spec in none of the known layouts (the message says which keys it has)."""


def parse_spec(spec: Mapping[str, Any] | str) -> dict:
    """A test spec (dict or its JSON string) checked and tagged with its "kind":
    "function" | "stdio" | "call" | "assert"."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise SpecError(f"code test spec is not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(spec, Mapping):
        raise SpecError(f"code test spec must be an object, got {type(spec).__name__}")
    keys = set(spec)

    def strings(name, values):
        if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
            raise SpecError(f"code test spec: {name!r} must be a list of strings")
        return list(values)

    if {"prompt", "entry_point", "test"} <= keys:
        for k in ("prompt", "entry_point", "test"):
            if not isinstance(spec[k], str):
                raise SpecError(f"code test spec: {k!r} must be a string")
        if not spec["entry_point"].isidentifier():
            raise SpecError(f"code test spec: entry_point {spec['entry_point']!r} is not a name")
        return {"kind": "function", "prompt": spec["prompt"], "entry_point": spec["entry_point"],
                "test": spec["test"]}
    if {"inputs", "outputs"} <= keys:
        inputs, outputs = spec["inputs"], spec["outputs"]
        if not isinstance(inputs, list) or not isinstance(outputs, list) or \
                len(inputs) != len(outputs) or not inputs:
            raise SpecError("code test spec: 'inputs' and 'outputs' must be non-empty lists of "
                            f"equal length (got {type(inputs).__name__} / "
                            f"{type(outputs).__name__})")
        if spec.get("fn_name"):
            if not isinstance(spec["fn_name"], str) or not spec["fn_name"].isidentifier():
                raise SpecError(f"code test spec: fn_name {spec['fn_name']!r} is not a name")
            return {"kind": "call", "fn_name": spec["fn_name"], "inputs": inputs,
                    "outputs": outputs}
        return {"kind": "stdio", "inputs": strings("inputs", inputs),
                "outputs": strings("outputs", outputs)}
    if "tests" in keys:
        tests = strings("tests", spec["tests"])
        if not tests:
            raise SpecError("code test spec: 'tests' is empty")
        setup = spec.get("setup") or ""
        if not isinstance(setup, str):
            raise SpecError("code test spec: 'setup' must be a string")
        return {"kind": "assert", "tests": tests, "setup": setup}
    raise SpecError(f"code test spec has keys {sorted(keys)}; expected one of: "
                    "{prompt, entry_point, test} (HumanEval), {inputs, outputs[, fn_name]} "
                    "(stdin/stdout or call-based), {tests[, setup]} (assert list)")


def is_spec(value: Any) -> bool:
    """Whether `value` (a dict or its JSON string) is a test spec parse_spec accepts."""
    try:
        parse_spec(value)
        return True
    except SpecError:
        return False


def num_tests(spec: dict) -> int:
    return {"function": 1, "stdio": len(spec.get("inputs", ())),
            "call": len(spec.get("inputs", ())), "assert": len(spec.get("tests", ()))}[spec["kind"]]


_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)^[ \t]*```[ \t]*$",
                       re.MULTILINE | re.DOTALL)


def extract_program(response: str) -> str:
    """The program in a response: the last fenced ```python (or ```py / ```python3) block, else
    the last untagged ``` block, else the whole response. The block's text is kept verbatim
    (a function body keeps its indentation)."""
    if not isinstance(response, str):
        raise TypeError(f"extract_program expects str, got {type(response).__name__}")
    tagged, untagged = None, None
    for m in _FENCE_RE.finditer(response):
        lang = m.group(1).lower()
        if lang in ("python", "py", "python3"):
            tagged = m.group(2)
        elif not lang:
            untagged = m.group(2)
    program = tagged if tagged is not None else untagged
    return response if program is None else program


def outputs_match(got: str, expected: str) -> bool:
    """Equal after stripping trailing whitespace per line and trailing blank lines."""
    def norm(text):
        lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines
    return norm(got) == norm(expected)


def _plain(value):
    """Tuples as lists, recursively (call-based answers come from JSON)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def call_result_matches(result, expected) -> bool:
    """fn(*inputs) == outputs[i]; APPS stores a return value wrapped in a one-element list."""
    result = _plain(result)
    expected = _plain(expected)
    return result == expected or (isinstance(expected, list) and len(expected) == 1
                                  and result == expected[0])


# ---------------------------------------------------------------------------------------------
# Linux plumbing (ctypes: Python 3.11 has no os.unshare / os.mount)
# ---------------------------------------------------------------------------------------------

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
AT_RECURSIVE, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x8000, 1, 2
_SYS_MOUNT_SETATTR = 442      # same number on x86_64 and the asm-generic tables (arm64)
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
_CAP_VERSION_3 = 0x20080522
NOBODY = 65534
_TMPFS_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")

_libc = None


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _enter_namespaces(tmpfs_mb: int) -> None:
    """S: new user/mount/net/ipc/uts/pid namespaces, the uid mapped, a read-only root, tmpfs."""
    libc = _lib()
    uid, gid = os.geteuid(), os.getegid()
    # Raise the process limit to the hard limit first: the new namespace's limit on the
    # *parent* level is copied from ours now, and every sandbox of this uid shares that level.
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
                        | CLONE_NEWPID), "unshare(user, mount, net, ipc, uts, pid namespaces)")
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)  # (nodev: no /dev/null)
    ret = libc.syscall(_SYS_MOUNT_SETATTR, -100, b"/", AT_RECURSIVE, ctypes.byref(attr),
                       ctypes.sizeof(attr))
    _check(0 if ret == 0 else -1, "mount_setattr(/, read-only, recursive) (Linux >= 5.12)")
    for path in _TMPFS_DIRS:
        if os.path.isdir(path) and not os.path.islink(path):
            _check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                              f"size={tmpfs_mb}m,mode=1777".encode()), f"mount tmpfs on {path}")


def _can_traverse(st: os.stat_result, uid: int) -> bool:
    if st.st_uid == uid:
        return bool(st.st_mode & 0o100)
    if st.st_gid == uid:
        return bool(st.st_mode & 0o010)
    return bool(st.st_mode & 0o001)


def _blocked_ancestor(path: str, uid: int) -> tuple[str, str] | None:
    """(the first ancestor directory of `path` that `uid` cannot enter, the next component of
    `path` inside it), or None when every ancestor can be entered."""
    parts = [p for p in os.path.abspath(path).split(os.sep) if p]
    current = "/"
    for part in parts:
        if not _can_traverse(os.stat(current), uid):
            return current, part
        current = os.path.join(current, part)
    return None


def _expose_python_to(uid: int) -> None:
    """S, still root: a private mount namespace in which `uid` can read this interpreter's
    modules. A Python installed under a root-only directory (pyenv in /root) would otherwise
    be unreadable after dropping root: a directory that blocks the way is covered with an empty
    tmpfs (mode 755) holding bind mounts of the needed entries only, so nothing else in it shows."""
    libc = _lib()
    _check(libc.unshare(CLONE_NEWNS), "unshare(mount namespace)")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    for _ in range(8):  # each round opens one level of blocking directories
        blocked: dict[str, set[str]] = {}
        for path in {sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path}:
            if path and os.path.exists(path):
                hit = _blocked_ancestor(path, uid)
                if hit is not None:
                    blocked.setdefault(hit[0], set()).add(hit[1])
        if not blocked:
            return
        for directory, names in blocked.items():
            fds = {name: os.open(os.path.join(directory, name), os.O_PATH) for name in names}
            try:
                _check(libc.mount(b"tmpfs", directory.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                                  b"size=1m,mode=755"), f"mount tmpfs on {directory}")
                for name, fd in fds.items():
                    target = os.path.join(directory, name)
                    if os.path.isdir(f"/proc/self/fd/{fd}"):
                        os.mkdir(target)
                    else:
                        open(target, "w").close()
                    _check(libc.mount(f"/proc/self/fd/{fd}".encode(), target.encode(), None,
                                      MS_BIND | MS_REC, None), f"bind {target}")
            finally:
                for fd in fds.values():
                    os.close(fd)
    raise OSError(errno.ELOOP, "could not make the Python installation readable to the sandbox")


def _drop_capabilities() -> None:
    """P: no capabilities left (a forked harness keeps the namespace's capabilities otherwise,
    and could unmount the tmpfs to reach the host's /tmp), and no way to gain them back."""
    libc = _lib()
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability (EINVAL)
    number = _SYS_CAPSET.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"capset: unknown syscall number on {os.uname().machine}")
    header = _CapHeader(_CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(0 if libc.syscall(number, ctypes.byref(header), data) == 0 else -1, "capset(none)")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")


def _drop_root() -> None:
    """As root: become uid/gid 65534 (the kernel exempts uid 0 from RLIMIT_NPROC)."""
    if os.geteuid() != 0:
        return
    try:
        os.setgroups([])
    except PermissionError:
        pass  # a user namespace with setgroups denied: there are no groups to drop
    try:
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return  # inside a user namespace that maps no uid 65534: stay its root
    _lib().prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)


def _die_with_parent(parent_pid: int | None) -> None:
    _lib().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(70)  # the parent is already gone


def _set_limits(limits: Limits) -> None:
    mb = 1 << 20
    cpu = limits.cpu_seconds
    for res, value in ((resource.RLIMIT_AS, limits.memory_mb * mb),
                       (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                       (resource.RLIMIT_FSIZE, limits.file_mb * mb),
                       (resource.RLIMIT_NPROC, limits.max_processes),
                       (resource.RLIMIT_NOFILE, 256),
                       (resource.RLIMIT_CORE, 0)):
        soft, hard = value if isinstance(value, tuple) else (value, value)
        _, cur_hard = resource.getrlimit(res)
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(res, (soft, hard))


def _scrub_environment(home: str) -> None:
    os.environ.clear()
    os.environ.update({
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home,
        "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1"})


def _close_fds(keep: tuple[int, ...]) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    keep_set = set(keep) | {0, 1, 2}
    start = 3
    for fd in sorted(keep_set | {null}):
        if fd >= start:
            os.closerange(start, fd)
            start = fd + 1
    os.closerange(start, 1 << 16)
    if null not in keep_set:
        try:
            os.close(null)
        except OSError:
            pass


def _wait_deadline(pid: int, deadline: float) -> int | None:
    """Waits for child `pid` until the monotonic deadline; its wait status, or None."""
    fd = os.pidfd_open(pid)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                return os.waitpid(pid, 0)[1]
    finally:
        os.close(fd)


def _kill_and_reap(pid: int) -> int:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return os.waitpid(pid, 0)[1]


# ---------------------------------------------------------------------------------------------
# The harness (runs in P and T, inside the sandbox)
# ---------------------------------------------------------------------------------------------


def _defines(program: str, name: str) -> bool:
    """Whether the program defines `name` at top level (a def, class or assignment)."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def _fresh_namespace() -> dict:
    return {"__name__": "__main__", "__builtins__": builtins}


def _t_report(fd: int, nonce: str, line: str) -> None:
    os.write(fd, f"{nonce} {line}\n".encode("utf-8", "replace"))


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]


def _t_run_program_tests(spec: dict, program: str, report_fd: int, nonce: str,
                         stop_at_first_failure: bool) -> None:
    """T for function / call / assert specs: one process runs the program and every test."""
    ns = _fresh_namespace()
    kind = spec["kind"]
    if kind == "function":
        entry = spec["entry_point"]
        if _defines(program, entry):
            # The prompt's imports and helper functions (when it compiles on its own: a prompt
            # may end in a bare signature), then the program's own definition.
            try:
                prompt_code = compile(spec["prompt"], "<prompt>", "exec")
            except SyntaxError:
                prompt_code = None
            if prompt_code is not None:
                exec(prompt_code, ns)
            exec(compile(program, "<program>", "exec"), ns)
        else:
            exec(compile(spec["prompt"] + program, "<program>", "exec"), ns)
        exec(compile(spec["test"], "<test>", "exec"), ns)
        ns["check"](ns[entry])
        _t_report(report_fd, nonce, "pass 0")
        return
    if kind == "assert":
        if spec["setup"]:
            exec(compile(spec["setup"], "<setup>", "exec"), ns)
        exec(compile(program, "<program>", "exec"), ns)
        for i, test in enumerate(spec["tests"]):
            try:
                exec(compile(test, f"<test {i}>", "exec"), ns)
            except Exception as e:  # noqa: BLE001 - a failing test, reported
                _t_report(report_fd, nonce, f"fail {i} {_short(e)}")
                if stop_at_first_failure:
                    return
                continue
            _t_report(report_fd, nonce, f"pass {i}")
        return
    # call-based
    exec(compile(program, "<program>", "exec"), ns)
    name = spec["fn_name"]
    fn = ns.get(name)
    if fn is None and isinstance(ns.get("Solution"), type):
        fn = getattr(ns["Solution"](), name, None)
    if not callable(fn):
        raise NameError(f"the program defines no function {name!r}")
    for i, (args, expected) in enumerate(zip(spec["inputs"], spec["outputs"])):
        try:
            args = args if isinstance(args, list) else [args]
            ok = call_result_matches(fn(*args), expected)
            why = "wrong answer"
        except Exception as e:  # noqa: BLE001
            ok, why = False, _short(e)
        _t_report(report_fd, nonce, f"pass {i}" if ok else f"fail {i} {why}")
        if not ok and stop_at_first_failure:
            return


def _t_main(target, report_fd: int, nonce: str) -> None:
    """Body of a T process: run `target`, report "done", exit 0. An exception (or the program
    exiting on its own, os._exit included) leaves no "done" line: the run failed."""
    status = 1
    try:
        target()
        _t_report(report_fd, nonce, "done")
        status = 0
    except SystemExit as e:
        _t_report(report_fd, nonce, f"error SystemExit({e.code!r}) before the tests finished")
    except BaseException as e:  # noqa: BLE001
        try:
            _t_report(report_fd, nonce, f"error {_short(e)}")
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(status)


def _signal_name(status: int) -> str:
    try:
        return signal.Signals(os.WTERMSIG(status)).name
    except ValueError:
        return f"signal {os.WTERMSIG(status)}"


def _p_run_tests(spec: dict, program: str, deadline: float, workdir: str,
                 pass_fraction: bool) -> dict:
    """P: every test of the spec; a verdict dict {status, passed, total, message}."""
    total = num_tests(spec)
    stop_first = not pass_fraction
    if spec["kind"] != "stdio":
        status, lines, done = _fork_t(
            lambda fd, nonce: _t_run_program_tests(spec, program, fd, nonce, stop_first),
            deadline)
        passed = len({ln for ln in lines if ln.startswith("pass ")})
        message = next((ln for ln in lines if ln.startswith(("fail ", "error "))), "")
        if status is None:
            return {"status": TIMEOUT, "passed": passed, "total": total,
                    "message": f"no result within the time limit ({message})" if message
                    else "no result within the time limit"}
        if os.WIFSIGNALED(status):
            sig = _signal_name(status)
            return {"status": TIMEOUT if sig == "SIGXCPU" else CRASH, "passed": passed,
                    "total": total, "message": f"killed by {sig}"}
        if not done:
            passed = 0 if spec["kind"] == "function" else passed
        return {"status": OK, "passed": passed, "total": total,
                "message": message or ("" if done else "the program exited before the tests "
                                       "finished")}
    # stdin/stdout: one T per test, the program compiled once.
    try:
        code = compile(program, "<program>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return {"status": OK, "passed": 0, "total": total, "message": _short(e)}
    passed, message = 0, ""
    for i, (stdin, expected) in enumerate(zip(spec["inputs"], spec["outputs"])):
        in_path = os.path.join(workdir, f".stdin{i}")
        out_path = os.path.join(workdir, f".stdout{i}")
        with open(in_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        status = _fork_stdio(code, in_path, out_path, deadline)
        if status is None:
            return {"status": TIMEOUT, "passed": passed, "total": total,
                    "message": f"test {i}: no result within the time limit"}
        if os.WIFSIGNALED(status):
            sig = _signal_name(status)
            if sig == "SIGXCPU":
                return {"status": TIMEOUT, "passed": passed, "total": total,
                        "message": f"test {i}: CPU time limit"}
            ok, why = False, f"killed by {sig}"
        elif os.WEXITSTATUS(status) != 0:
            ok, why = False, f"exit status {os.WEXITSTATUS(status)}"
        else:
            try:
                with open(out_path, encoding="utf-8", errors="replace") as f:
                    got = f.read()
            except OSError as e:
                got, why = None, _short(e)
            ok = got is not None and outputs_match(got, expected)
            why = "" if ok else "wrong answer"
        for path in (in_path, out_path):
            try:
                os.unlink(path)
            except OSError:
                pass
        if ok:
            passed += 1
        else:
            message = message or f"test {i}: {why}"
            if stop_first:
                break
    return {"status": OK, "passed": passed, "total": total, "message": message}


def _fork_t(body, deadline: float):
    """P: runs body(report_fd, nonce) in a forked T; returns (wait status or None on timeout,
    the report lines carrying this run's nonce, whether T reported "done")."""
    nonce = secrets.token_hex(8)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _t_main(lambda: body(w, nonce), w, nonce)
    os.close(w)
    return _collect_t(pid, r, nonce, deadline)


def _read_until(r: int, deadline: float, limit: int | None = None) -> bytes:
    """What a pipe delivers until it closes or the deadline passes (at most about `limit`
    bytes are kept; the rest is read and dropped so the writer never blocks)."""
    chunks, size = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([r], [], [], left)
        if not ready:
            break
        data = os.read(r, 65536)
        if not data:
            break
        if limit is None or size < limit:
            chunks.append(data)
            size += len(data)
    return b"".join(chunks)


def _collect_t(pid: int, r: int, nonce: str, deadline: float):
    status = None
    try:
        out = _read_until(r, deadline, limit=1 << 20)
        if time.monotonic() < deadline:
            status = _wait_deadline(pid, deadline)
    finally:
        os.close(r)
        if status is None:
            _kill_and_reap(pid)
    lines = []
    for raw in out.decode("utf-8", "replace").splitlines():
        tag, _, rest = raw.partition(" ")
        if tag == nonce:
            lines.append(rest)
    return status, lines, "done" in lines


def _fork_stdio(code, in_path: str, out_path: str, deadline: float) -> int | None:
    """P: one stdin/stdout test in a forked T; its wait status, or None on timeout."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            fd_in = os.open(in_path, os.O_RDONLY)
            fd_out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd_in, 0)
            os.dup2(fd_out, 1)
            os.close(fd_in)
            os.close(fd_out)
            sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8",
                                         errors="replace")
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                          errors="replace", write_through=False)
            sys.argv = ["main.py"]
            try:
                exec(code, _fresh_namespace())
                status = 0
            except SystemExit as e:
                status = 0 if e.code in (None, 0) else 1
            except BaseException:  # noqa: BLE001 - a runtime error fails the test
                traceback.print_exc()
                status = 1
            try:
                sys.stdout.flush()
            except BaseException:  # noqa: BLE001 - e.g. the file size limit
                status = 1
        finally:
            os._exit(status)
    status = _wait_deadline(pid, deadline)
    if status is None:
        _kill_and_reap(pid)
    return status


# ---------------------------------------------------------------------------------------------
# One program: W -> S -> P
# ---------------------------------------------------------------------------------------------


def _p_main(spec, program, limits, deadline, result_fd, workdir, isolate, pass_fraction):
    """P: set up the sandbox's inside, run the tests, write the verdict, exit."""
    verdict = {"status": ERROR, "passed": 0, "total": num_tests(spec), "message": "no verdict"}
    try:
        if isolate:
            try:
                _lib().mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            except Exception:  # noqa: BLE001 - a fresh /proc only hides host processes
                pass
            os.makedirs(workdir, exist_ok=True)
        os.chdir(workdir)
        _close_fds(keep=(result_fd,))
        _scrub_environment(workdir)
        if isolate:
            _drop_capabilities()
        _set_limits(limits)
        if hasattr(sys, "set_int_max_str_digits"):
            sys.set_int_max_str_digits(0)  # data sets' expected outputs predate the limit
        verdict = _p_run_tests(spec, program, deadline, workdir, pass_fraction)
    except BaseException as e:  # noqa: BLE001 - the sandbox failed, not the program
        verdict = {"status": ERROR, "passed": 0, "total": num_tests(spec),
                   "message": f"sandbox set-up failed: {_short(e)}"}
    finally:
        try:
            os.write(result_fd, json.dumps(verdict).encode())
        finally:
            os._exit(0)


def _s_main(spec, program, limits, deadline, result_fd, workdir, isolate, pass_fraction,
            parent_pid):
    """S: leave W's session, drop root, enter the namespaces, fork P, kill it at the deadline."""
    code = 0
    try:
        os.setsid()
        if isolate and os.geteuid() == 0:
            _expose_python_to(NOBODY)
        _drop_root()
        _die_with_parent(parent_pid)
        if isolate:
            _enter_namespaces(limits.tmpfs_mb)
            _die_with_parent(None)  # credentials changed: set again
        pid = os.fork()
        if pid == 0:
            _die_with_parent(None)
            _p_main(spec, program, limits, deadline, result_fd, workdir, isolate, pass_fraction)
        os.close(result_fd)
        status = _wait_deadline(pid, deadline + 1.0)
        if status is None:
            _kill_and_reap(pid)  # pid 1 of the namespace: the kernel kills the rest
            code = 3
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(result_fd, json.dumps({
                "status": ERROR, "passed": 0, "total": num_tests(spec),
                "message": f"sandbox set-up failed: {_short(e)}"}).encode())
        except OSError:
            pass
        code = 2
    finally:
        os._exit(code)


def run_program(program: str, spec: Mapping[str, Any] | str, limits: Limits | None = None,
                isolate: bool = True, pass_fraction: bool = False) -> dict:
    """Runs `program` against the tests of `spec` in a fresh sandbox; returns
    {"status": "ok" | "timeout" | "crash" | "error", "passed", "total", "message", "seconds"}.

    "ok": the tests ran to a verdict (passed of total; without pass_fraction it stops at the
    first failing test). "timeout": the wall or CPU limit ended it. "crash": it was killed by a
    signal (e.g. SIGSEGV). "error": the sandbox itself failed (the message says how).
    Forks: call it in a single-threaded process (a VerifyPool worker).
    """
    limits = limits or Limits()
    spec = parse_spec(spec) if "kind" not in spec else spec  # type: ignore[operator]
    t0 = time.monotonic()
    deadline = t0 + limits.timeout_s
    host_dir = None
    if isolate:
        workdir = "/tmp/work"
    else:
        host_dir = tempfile.mkdtemp(prefix="delta_jax_sandbox_")
        workdir = host_dir
        if os.geteuid() == 0:
            try:
                os.chown(host_dir, NOBODY, NOBODY)  # S drops to it (see _drop_root)
            except OSError as e:
                if e.errno != errno.EINVAL:  # uid 65534 unmapped: S stays root
                    raise
    r, w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _s_main(spec, program, limits, deadline, w, workdir, isolate, pass_fraction, parent)
    os.close(w)
    out = b""
    try:
        hard_deadline = deadline + 3.0
        out = _read_until(r, hard_deadline)
    finally:
        os.close(r)
        # S reaps P (pid 1 of the namespace, which takes every process in it down) and exits;
        # only if it does not (it hung, or this thread was interrupted) is its session killed.
        # Killing S first would leave P a zombie for the host's init to reap.
        status = None
        try:
            status = _wait_deadline(pid, max(time.monotonic(), hard_deadline) + 2.0)
        except (OSError, KeyboardInterrupt):
            pass
        try:
            os.killpg(pid, signal.SIGKILL)  # S's session: whatever stayed in it (no isolation)
        except (ProcessLookupError, PermissionError):
            pass
        if status is None:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        if host_dir is not None:
            shutil.rmtree(host_dir, ignore_errors=True)
    seconds = time.monotonic() - t0
    try:
        verdict = json.loads(out.decode())
    except ValueError:
        verdict = {"status": TIMEOUT if seconds >= limits.timeout_s else ERROR, "passed": 0,
                   "total": num_tests(spec), "message": "the sandbox returned no verdict"}
    verdict["seconds"] = seconds
    return verdict


# ---------------------------------------------------------------------------------------------
# Isolation probe and the pool entry point
# ---------------------------------------------------------------------------------------------

_PROBE_PROGRAM = """
import os, socket, fractions, decimal  # modules the worker itself never imported
assert os.getpid() == 2, os.getpid()
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    raise SystemExit("network reachable")
except OSError:
    pass
try:
    open("/etc/delta_jax_probe", "w")
    raise SystemExit("root filesystem writable")
except OSError:
    pass
open("/tmp/probe", "w").write("ok")
"""


def check_isolation() -> tuple[bool, str]:
    """(True, "") when this host can run the isolated sandbox, else (False, why). Forks: call it
    in a worker (RewardScorer does), not in a process with JAX threads."""
    if sys.platform != "linux":
        return False, f"the sandbox needs Linux namespaces; this is {sys.platform}"
    if not hasattr(os, "pidfd_open"):
        return False, "os.pidfd_open is missing (Linux >= 5.3 and Python >= 3.9 needed)"
    try:
        verdict = run_program(_PROBE_PROGRAM, {"tests": ["pass"]}, Limits(timeout_s=20.0),
                              isolate=True)
    except Exception as e:  # noqa: BLE001
        return False, _short(e)
    if verdict["status"] == OK and verdict["passed"] == 1:
        return True, ""
    message = verdict.get("message") or verdict["status"]
    if "unshare" in message and ("EPERM" in message or "not permitted" in message
                                 or "Invalid argument" in message or "No space" in message):
        message += (" (user namespaces are not available to this user: e.g. "
                    "kernel.unprivileged_userns_clone=0, user.max_user_namespaces=0, or a "
                    "container seccomp profile that blocks unshare)")
    return False, message


def worker_entry(request: dict) -> dict:
    """VerifyPool entry point: {"op": "probe"} -> {"ok", "why"}; {"op": "run", "program",
    "spec", "limits": {...}, "isolate", "pass_fraction"} -> run_program's verdict."""
    if request.get("op") == "probe":
        ok, why = check_isolation()
        return {"ok": ok, "why": why}
    return run_program(request["program"], request["spec"], Limits(**request["limits"]),
                       isolate=request["isolate"], pass_fraction=request["pass_fraction"])
