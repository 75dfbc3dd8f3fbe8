"""The sandbox's seccomp filter: the system calls model-written code is refused (a table, with where each entry comes
from), compiled to a BPF program by libseccomp (through pyseccomp) once per process. The sandbox's child loads the
compiled program with one prctl (evenrl.isolation.jail.seccomp) and imports nothing: importing pyseccomp there would
add 70-100 ms to every call on a loaded 2-core machine (ctypes.util, then `ldconfig -p` to find the library).

Default allow; the entries are Docker's default profile (moby/profiles seccomp/default.json) read for a container
with no capabilities, which is what the sandbox's code is: every system call that profile leaves out or allows only
to a capability the code lacks, plus a few that Flatpak (the program it hands bubblewrap) and firejail refuse. Only
the native architecture is in the filter: a call made through another ABI (int 0x80, x32) kills the process.
"""

from __future__ import annotations

import errno
import functools
import tempfile

# (system calls, what they reach, where the entry comes from): refused with EPERM unless said otherwise.
DENIED = (
    (("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "process_madvise"),
     "reading or changing another process's memory",
     "Docker (CAP_SYS_PTRACE; it allows ptrace and process_vm_* from Linux 4.8), Flatpak (ptrace)"),
    (("kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "create_module",
      "query_module", "get_kernel_syms"), "loading kernels and kernel modules",
     "Docker (CAP_SYS_MODULE, CAP_SYS_BOOT)"),
    (("bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
      "fanotify_init", "lookup_dcookie"),
     "kernel subsystems behind many local privilege escalations", "Docker (CAP_SYS_ADMIN, CAP_BPF, CAP_PERFMON)"),
    (("keyctl", "add_key", "request_key"), "the kernel keyring (not namespaced)", "Docker"),
    (("mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount", "fspick",
      "fsconfig", "mount_setattr", "unshare", "setns"),
     "mounts and namespaces (the sandbox's own are made before the filter)", "Docker (CAP_SYS_ADMIN, CAP_SYS_CHROOT)"),
    (("open_by_handle_at", "name_to_handle_at"), "files by handle, around the mount view",
     "Docker (open_by_handle_at: CAP_DAC_READ_SEARCH), firejail (name_to_handle_at)"),
    (("swapon", "swapoff", "reboot", "acct", "quotactl", "quotactl_fd", "syslog", "vhangup", "sethostname",
      "setdomainname"), "machine administration", "Docker (CAP_SYS_ADMIN, CAP_SYS_BOOT, CAP_SYSLOG, ...)"),
    (("settimeofday", "clock_settime", "adjtimex", "clock_adjtime"), "the system clock",
     "Docker (CAP_SYS_TIME; it allows adjtimex and clock_adjtime, which only read without it)"),
    (("iopl", "ioperm", "modify_ldt"), "I/O ports and the x86 segment table",
     "Docker (CAP_SYS_RAWIO), Flatpak (modify_ldt)"),
    (("mbind", "set_mempolicy", "get_mempolicy", "set_mempolicy_home_node", "migrate_pages", "move_pages"),
     "NUMA placement (numpy and BLAS run without it, as in Docker)", "Docker (CAP_SYS_NICE)"),
    (("uselib", "ustat", "sysfs", "_sysctl", "nfsservctl", "afs_syscall", "getpmsg", "putpmsg", "security",
      "tuxcall", "vserver"), "obsolete or unimplemented calls", "Docker"),
    (("memfd_create", "memfd_secret", "shmget", "shmat"),
     "memory that no process needs to map (a memfd filled with write(), SysV segments left detached): no rlimit "
     "counts it, so it would pass the memory cap", "evenrl (Docker allows them; it caps memory with a cgroup)"),
)
# clone and clone3 creating namespaces: clone is refused only with a namespace flag (threads and fork use none);
# clone3 passes its flags in memory a filter cannot read, so it fails with ENOSYS and libc falls back to clone.
CLONE_NAMESPACE_FLAGS = (0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)
# socket families Docker refuses: AF_ALG (the kernel's crypto API) and AF_VSOCK (to the hypervisor).
SOCKET_FAMILIES = (38, 40)
# personality flags that turn off address-space randomisation or memory protection (Docker allows only the
# default execution domains; a filter that allows by default can refuse the flags only, and so also refuses the
# query personality(0xffffffff), which sets them all): ADDR_NO_RANDOMIZE, ADDR_COMPAT_LAYOUT, MMAP_PAGE_ZERO,
# READ_IMPLIES_EXEC, ADDR_LIMIT_32BIT, ADDR_LIMIT_3GB.
PERSONALITY_FLAGS = (0x40000, 0x200000, 0x100000, 0x400000, 0x800000, 0x8000000)
# ioctls that push input into a terminal or drive the console (Flatpak): TIOCSTI, TIOCLINUX,
# compared on the low 32 bits only, as the kernel reads them (CVE-2019-10063).
TERMINAL_IOCTLS = (0x5412, 0x541C)


def names() -> list[str]:
    """Every system call the filter refuses outright, and clone3."""
    return [name for group, _, _ in DENIED for name in group] + ["clone3"]


@functools.lru_cache(maxsize=1)
def program() -> tuple[bytes, str | None]:
    """(the compiled BPF program or b"", why there is none or what it leaves out: None when complete)."""
    try:
        import pyseccomp as sc
    except ImportError:
        return b"", "pyseccomp is not installed: pip install pyseccomp"
    except (RuntimeError, OSError):  # pyseccomp raises RuntimeError where libseccomp is not on the machine
        return b"", "libseccomp is not installed: apt-get install libseccomp2 (dnf install libseccomp)"
    deny = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    unknown = []
    for name in names():
        if sc.resolve_syscall(sc.Arch.NATIVE, name) == -1:  # newer than this libseccomp
            unknown.append(name)
            continue
        f.add_rule(sc.ERRNO(errno.ENOSYS) if name == "clone3" else deny, name)
    for flag in CLONE_NAMESPACE_FLAGS:
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for family in SOCKET_FAMILIES:
        f.add_rule(deny, "socket", sc.Arg(0, sc.EQ, family))
    for flag in PERSONALITY_FLAGS:
        f.add_rule(deny, "personality", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for request in TERMINAL_IOCTLS:
        f.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        bpf = out.read()
    return bpf, (f"the installed libseccomp does not know {', '.join(unknown)}: upgrade libseccomp" if unknown
                 else None)
