"""The first process inside a grading sandbox (``harness.sandbox``): it shapes the filesystem, then becomes the
candidate's program.

Run by ``unshare --user --map-root-user --mount --pid --fork --mount-proc`` as the new PID namespace's first
process, with root's rights over that namespace only. It reads its instructions as JSON from stdin (never from
its command line or environment, which the program it becomes could read back), then:

1. hides each ``hidden`` folder under an empty tmpfs (the answer keys and their event log) and each hidden file
   under an empty one (``/dev/null`` bound over it);
2. makes every mount read-only, recursively (the checkout, its caches, the interpreter's site-packages);
3. binds each ``writable`` folder back read-write (the exercise folder, a private temporary folder) and gives the
   namespace a private ``/dev/shm`` (ranks share tensors through it);
4. enters a nested user and mount namespace (``unshare --user --mount``) and execs the program there: inherited
   mounts are locked in a less privileged namespace, so the program cannot unmount what hides the keys.

The program is then PID 1 of its namespace: when it exits, the kernel kills every process it left behind. Standard
library only (it runs before anything of the project may be read).
"""

import ctypes
import json
import os
import sys

MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY = 0x1
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and arm64 (Linux >= 5.12)

_libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target: str, fstype, flags: int, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def set_readonly(path: str, readonly: bool) -> None:
    """Set (or clear) the read-only attribute of the mount at ``path`` and every mount below it."""
    attr = MountAttr(attr_set=MOUNT_ATTR_RDONLY if readonly else 0, attr_clr=0 if readonly else MOUNT_ATTR_RDONLY)
    result = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE, ctypes.byref(attr),
                           ctypes.sizeof(attr))
    _check(result, f"mount_setattr {path}")


def main() -> None:
    spec = json.loads(sys.stdin.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    for path in spec["hidden"]:
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=16k,mode=000")
        elif os.path.isfile(path):
            mount(os.devnull, path, None, MS_BIND)
    set_readonly("/", True)
    for path in spec["writable"]:
        mount(path, path, None, MS_BIND | MS_REC)
        set_readonly(path, False)
    if os.path.isdir("/dev/shm"):
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    os.chdir(spec["cwd"])
    os.execvpe("unshare", ["unshare", "--user", "--mount", "--", *spec["argv"]], spec["env"])


if __name__ == "__main__":
    try:
        main()
    except OSError as exc:  # the sandbox could not be built: the grader reports it, nothing of the program ran
        print(f"faultbench-jail: {exc}", file=sys.stderr)
        sys.exit(125)
