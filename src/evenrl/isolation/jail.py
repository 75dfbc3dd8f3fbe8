"""The first process inside a sandbox (evenrl.isolation.sandbox builds the command): started by util-linux `unshare`
as PID 1 of new PID, mount, network, IPC and UTS namespaces, as `python -I -c <this file's text> <settings JSON>`.
It imports nothing of evenrl (the sandbox need not see evenrl's source), so it reads its settings from argv.

PID 1 builds the sandbox's file system in its private mount namespace: a small read-only tmpfs root holding
read-only, nosuid, nodev bind mounts of the system directories and the Python installation only (no run directory,
data, checkpoints or home), a fresh size-capped tmpfs at /tmp (the only writable place), a minimal /dev and the
namespace's own /proc. Then it forks the child that runs the untrusted code: the child chroots into that root, sets
its rlimits, drops to an unprivileged uid (a uid no account uses when the trainer is root; uid 65534 of a nested user
namespace otherwise) with no capabilities and no_new_privs, restricts itself with Landlock (settings "landlock": the
kernel's ABI, 0 for none) and loads the seccomp filter (settings "seccomp": the BPF program libseccomp compiled in
the trainer, evenrl.isolation.syscalls; empty for none), and runs the code (settings "code": Python read from
stdin) or execs a program ("argv"); both layers hold for everything it starts. The code (mode "code") may hold
"memory_bytes" beyond the interpreter that runs it, shared memory included (cap_memory). PID 1 waits for that child only and
exits with its status; when PID 1 exits the kernel kills everything left in the namespace (daemons, forked
children), and `unshare --kill-child` makes PID 1 die with its parent, so the trainer ends the whole sandbox by
killing the one process it started.
"""

import ctypes
import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
# statvfs flags of a mount that a user namespace may not clear on remount: keep them (else EPERM).
_KEPT = {8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}  # noexec, noatime, nodiratime, relatime
CLONE_NEWUSER = 0x10000000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
# Landlock (linux/landlock.h): its system calls have these numbers on every architecture; access rights by the ABI
# version that brought them (1: the first 13 file-system rights, 2: REFER, 3: TRUNCATE, 4: TCP, 5: IOCTL_DEV,
# 6: scoping abstract unix sockets and signals to the sandbox's own processes).
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR, FS_MAKE_CHAR, FS_MAKE_BLOCK = 1, 2, 4, 8, 64, 2048
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_BIND_TCP, NET_CONNECT_TCP, SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2, 1, 2
EXIT_SETUP = 125  # the sandbox could not be built; its one-line reason is on stderr
EXIT_MEMORY, EXIT_BLOCKED = 90, 91

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.syscall.restype = ctypes.c_long


class _PathBeneath(ctypes.Structure):  # struct landlock_path_beneath_attr (packed)
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _SockFprog(ctypes.Structure):  # struct sock_fprog: a BPF program's length (instructions) and address
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or 'bind'} on {target}: {os.strerror(err)}")


def _read_only(target: str) -> None:
    """Remount every mount at or under `target` read-only, nosuid, nodev (a recursive bind copies submounts)."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].replace("\\040", " ") for line in f]
    for point in points:
        if point == target or point.startswith(target.rstrip("/") + "/"):
            kept = 0
            for flag, ms in _KEPT.items():
                if os.statvfs(point).f_flag & flag:
                    kept |= ms
            _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)


def build_root(root: str, paths: list, tmp_bytes: int) -> None:
    """The sandbox's file system at `root` (a directory of the trainer's, covered by a tmpfs of this namespace)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the trainer's mount table
    _mount("evenrl-sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    os.makedirs(root + "/tmp")  # first: a path below /tmp to bind (a checkout there) goes on top of it
    _mount("evenrl-tmp", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={max(tmp_bytes, 4096)},nr_inodes=4096,mode=1777")
    for path in paths:
        inside = root + path
        if os.path.islink(path) and os.path.dirname(path) == "/":  # /bin -> usr/bin on merged-/usr systems
            os.symlink(os.readlink(path), inside)
            continue
        if not os.path.exists(path):
            continue
        if os.path.isdir(path):
            os.makedirs(inside, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            open(inside, "w").close()
        _mount(path, inside, None, MS_BIND | MS_REC)
        _read_only(inside)
    os.makedirs(root + "/dev")
    _mount("evenrl-dev", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for name in ("null", "zero", "random", "urandom"):
        open(f"{root}/dev/{name}", "w").close()
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for name, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                     ("stderr", "/proc/self/fd/2")):
        os.symlink(to, f"{root}/dev/{name}")
    _mount(None, root + "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.makedirs(root + "/proc")
    try:  # this namespace's processes only; where the kernel refuses (a masked /proc), the code has no /proc
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def cap_memory(memory_bytes: int) -> None:
    """Cap what this process can hold at `memory_bytes` beyond what it holds now (the interpreter running the code):
    RLIMIT_DATA (heap, private memory) and RLIMIT_AS (every mapping: shared anonymous memory, which RLIMIT_DATA does
    not count, SysV segments and memfds while mapped). 0: no cap. Reads /proc/self/status: call before chroot."""
    if not memory_bytes:
        return
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_AS, (size + memory_bytes, size + memory_bytes))


def enter(root: str, uid: int | None, limits: dict, memory_bytes: int = 0) -> None:
    """(In the child) chroot into `root`, take the rlimits and the memory cap (cap_memory) and become an
    unprivileged user for good."""
    if uid is None:  # not root outside: a nested user namespace in which this process is uid/gid 65534
        outer_uid, outer_gid = os.geteuid(), os.getegid()
        if _libc.unshare(CLONE_NEWUSER) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER) for the code's own user")
        for name, text in (("setgroups", "deny"), ("uid_map", f"65534 {outer_uid} 1"),
                           ("gid_map", f"65534 {outer_gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    cap_memory(memory_bytes)
    os.chroot(root)
    os.chdir("/tmp")
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if uid is None:
        os.setresgid(65534, 65534, 65534)
        os.setresuid(65534, 65534, 65534)
    else:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # from root to non-root: every capability is dropped
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def _syscall(number: int, *args) -> int:
    done = _libc.syscall(ctypes.c_long(number), *args)
    if done < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"system call {number}: {os.strerror(err)}")
    return done


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (Linux older than 5.13, or Landlock not enabled)."""
    return max(0, _libc.syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


def landlock(paths: list, abi: int) -> None:
    """(In the child, after no_new_privs) restrict this process and all it starts with Landlock ABI `abi` (the
    kernel's, landlock_abi(); 0: no Landlock, nothing done): read and execute under the read-only system `paths`,
    read /proc, list any directory, read and write /tmp and /dev/null and /dev/zero, read /dev/random and
    /dev/urandom, nothing else of the file system; from ABI 4 no TCP bind or connect; from ABI 6 no abstract unix
    socket or signal reaching a process outside the sandbox's code."""
    if abi < 1:
        return
    fs = (1 << 13) - 1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    fs |= FS_IOCTL_DEV if abi >= 5 else 0
    handled = (ctypes.c_uint64 * 3)(fs, NET_BIND_TCP | NET_CONNECT_TCP, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the kernel reads the fields its ABI knows
    ruleset = _syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(handled), ctypes.c_size_t(size), ctypes.c_uint32(0))
    read = FS_READ_FILE | FS_READ_DIR
    rules = [("/", FS_READ_DIR), ("/proc", read), ("/tmp", fs & ~(FS_MAKE_CHAR | FS_MAKE_BLOCK | FS_IOCTL_DEV)),
             ("/dev/null", FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE), ("/dev/zero", FS_READ_FILE | FS_WRITE_FILE),
             ("/dev/random", FS_READ_FILE), ("/dev/urandom", FS_READ_FILE)] + [(p, read | FS_EXECUTE) for p in paths]
    try:
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:  # not in this sandbox's view (a path that did not exist, no /proc)
                continue
            try:
                if not os.path.isdir(path):
                    access &= FS_FILE_RIGHTS
                rule = _PathBeneath(access & fs, fd)
                _syscall(LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.byref(rule),
                         ctypes.c_uint32(0))  # 1: LANDLOCK_RULE_PATH_BENEATH
            finally:
                os.close(fd)
        _syscall(LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)


def seccomp(program: bytes) -> None:
    """(In the child, after no_new_privs) load the seccomp filter libseccomp compiled (evenrl.isolation.syscalls)."""
    code = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(code))  # a BPF instruction is 8 bytes
    if _libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog),
                   ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def run_code(code: str) -> None:
    """Run Python source as __main__; the exit code says which limit it met (EXIT_MEMORY, EXIT_BLOCKED)."""
    sys.stderr = sys.stdout
    try:
        exec(compile(code, "<tool code>", "exec"), {"__name__": "__main__"})
    except MemoryError:
        print("MemoryError: the code ran out of memory", flush=True)
        os._exit(EXIT_MEMORY)
    except PermissionError as e:
        print(f"PermissionError: {e}", flush=True)
        os._exit(EXIT_BLOCKED)
    except SystemExit as e:
        sys.stdout.flush()
        os._exit(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
    except BaseException as e:
        import traceback
        lines = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next)).splitlines()
        print("\n".join(lines[-6:]), flush=True)
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def main(settings: dict) -> None:
    code = sys.stdin.read() if settings["mode"] == "code" else None
    try:
        build_root(settings["root"], settings["paths"], settings["tmp_bytes"])
    except OSError as e:
        print(f"evenrl sandbox: {e}", file=sys.stderr, flush=True)
        os._exit(EXIT_SETUP)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    env.update(settings.get("env", {}))
    child = os.fork()
    if child == 0:
        try:
            enter(settings["root"], settings["uid"], settings["limits"], settings.get("memory_bytes", 0))
            landlock(settings["paths"], settings["landlock"])
            if settings["seccomp"]:
                seccomp(bytes.fromhex(settings["seccomp"]))
        except OSError as e:
            print(f"evenrl sandbox: {e}", file=sys.stderr, flush=True)
            os._exit(EXIT_SETUP)
        os.environ.clear()
        os.environ.update(env)
        if code is not None:
            run_code(code)
        os.execve(settings["argv"][0], settings["argv"], env)
    for fd in (0, 1, 2):  # PID 1 keeps no pipe open: when the child closes them, the trainer sees the end
        os.dup2(os.open("/dev/null", os.O_RDWR), fd)
    while True:  # reaps orphans reparented to PID 1 too: a zombie would count against RLIMIT_NPROC
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(EXIT_SETUP)
        except InterruptedError:
            continue
        if pid == child:
            break
    # Exiting ends the namespace: the kernel kills every process left in it.
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
