#!/usr/bin/env python3
"""What this kernel's FUSE offers a progressive volume (issue #24), probed
with the raw /dev/fuse protocol, no library:

  python3 tests/scripts/probes/fuse-takeover.py     (as root)

1. The INIT handshake: the protocol minor version, and whether the kernel
   offers FUSE_PASSTHROUGH (6.9+) and FUSE_INIT_EXT.
2. A daemon killed (SIGKILL) while a reader waits in read(2), whose
   /dev/fuse descriptor a keeper process still holds: a new daemon takes
   the descriptor from the keeper (SCM_RIGHTS), sends FUSE_NOTIFY_RESEND,
   gets the pending READ again and answers it; the reader returns the right
   bytes. Prints each step and exits 0 only if every step held.

Not a test of the driver: a fact-finding probe for docs/design.md.
"""
import ctypes
import os
import signal
import socket
import struct
import sys
import tempfile
import time

FUSE_LOOKUP, FUSE_FORGET, FUSE_GETATTR, FUSE_OPEN, FUSE_READ = 1, 2, 3, 14, 15
FUSE_RELEASE, FUSE_FLUSH, FUSE_INIT, FUSE_OPENDIR, FUSE_READDIR = 18, 25, 26, 27, 28
FUSE_RELEASEDIR, FUSE_ACCESS, FUSE_DESTROY, FUSE_BATCH_FORGET = 29, 34, 38, 42
FUSE_INTERRUPT, FUSE_STATFS, FUSE_GETXATTR = 36, 17, 22
FUSE_INIT_EXT = 1 << 30
FUSE_PASSTHROUGH = 1 << 37
FUSE_NOTIFY_RESEND = 7
FUSE_UNIQUE_RESEND = 1 << 63
ENOSYS, ENOENT = 38, 2

CONTENT = b"progressive bytes, verified\n" * 100
IN_HDR = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad


def attr(ino, mode, size):
    # fuse_attr: ino size blocks atime mtime ctime atimensec mtimensec
    # ctimensec mode nlink uid gid rdev blksize flags
    return struct.pack("<QQQQQQIIIIIIIIII", ino, size, (size + 511) // 512, 0, 0, 0,
                       0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


def reply(fd, unique, payload=b"", error=0):
    os.write(fd, struct.pack("<IiQ", 16 + len(payload), -error if error else 0, unique) + payload)


def mount_fuse(mnt):
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,default_permissions".encode()
    if libc.mount(b"probe", mnt.encode(), b"fuse.probe", 0, opts) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return fd


def handshake(fd):
    buf = os.read(fd, 1 << 20)
    ln, op, unique, *_ = IN_HDR.unpack_from(buf)
    assert op == FUSE_INIT, op
    major, minor, ra, flags, flags2 = struct.unpack_from("<IIIII", buf, IN_HDR.size)
    offered = flags | (flags2 << 32)
    out = struct.pack("<IIIIHHIIHHII", 7, minor, ra, FUSE_INIT_EXT & flags, 16, 12,
                      128 * 1024, 1, 32, 0, 0, 0) + b"\0" * 24
    reply(fd, unique, out)
    return major, minor, offered


def serve(fd, hold_reads=False, log=print):
    """Answers until a READ arrives; returns that READ's (unique, resend)
    unanswered when hold_reads, else answers it and keeps going."""
    while True:
        buf = os.read(fd, 1 << 20)
        ln, op, unique, node, *_ = IN_HDR.unpack_from(buf)
        body = buf[IN_HDR.size:ln]
        if op == FUSE_LOOKUP:
            name = body.rstrip(b"\0")
            if node == 1 and name == b"weights":
                entry = struct.pack("<QQQQII", 2, 0, 60, 60, 0, 0) + attr(2, 0o100444, len(CONTENT))
                reply(fd, unique, entry)
            else:
                reply(fd, unique, error=ENOENT)
        elif op == FUSE_GETATTR:
            a = attr(1, 0o40555, 0) if node == 1 else attr(2, 0o100444, len(CONTENT))
            reply(fd, unique, struct.pack("<QII", 60, 0, 0) + a)
        elif op in (FUSE_OPEN, FUSE_OPENDIR):
            reply(fd, unique, struct.pack("<QII", 7, 0, 0))
        elif op == FUSE_READ:
            off, size = struct.unpack_from("<QI", body, 8)
            resend = bool(unique & FUSE_UNIQUE_RESEND)
            if hold_reads:
                return unique, resend
            log(f"  READ off={off} size={size} (resent: {resend}) answered")
            reply(fd, unique, CONTENT[off:off + size])
            return unique, resend
        elif op in (FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT):
            pass  # no reply
        elif op in (FUSE_RELEASE, FUSE_RELEASEDIR, FUSE_FLUSH):
            reply(fd, unique)
        else:
            reply(fd, unique, error=ENOSYS)


def main():
    mnt = tempfile.mkdtemp(prefix="fuse-probe-")
    ok = True
    fd = mount_fuse(mnt)
    # The keeper: a process that only holds a dup of the descriptor and
    # hands it to whoever connects, as a driver's fd holder would.
    keep_a, keep_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    keeper = os.fork()
    if keeper == 0:
        keep_a.close()
        held = os.dup(fd)
        os.close(fd)
        while True:
            try:
                keep_b.recv(1)
            except OSError:
                os._exit(0)
            socket.send_fds(keep_b, [b"f"], [held])
    keep_b.close()
    major, minor, offered = handshake(fd)
    print(f"INIT: protocol {major}.{minor}; kernel offers passthrough: {bool(offered & FUSE_PASSTHROUGH)}, "
          f"init_ext: {bool(offered & FUSE_INIT_EXT)}")
    # Daemon 1 answers the lookup and the open, takes the READ and dies
    # without answering it.
    r, w = os.pipe()
    reader = os.fork()
    if reader == 0:
        os.close(r)
        try:
            with open(os.path.join(mnt, "weights"), "rb") as f:
                data = f.read()
            os.write(w, b"OK" if data == CONTENT else b"WRONG")
        except OSError as e:
            os.write(w, f"ERR {e}".encode())
        os._exit(0)
    os.close(w)
    daemon = os.fork()
    if daemon == 0:
        unique, _ = serve(fd, hold_reads=True)
        print(f"daemon 1 (pid {os.getpid()}) holds READ #{unique} unanswered; killed now")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    os.close(fd)  # only the dying daemon and the keeper hold it now
    os.waitpid(daemon, 0)
    time.sleep(0.2)
    # Daemon 2: the descriptor from the keeper, then RESEND.
    keep_a.send(b"?")
    _, fds, _, _ = socket.recv_fds(keep_a, 1, 1)
    fd2 = fds[0]
    print("daemon 2 took the descriptor from the keeper")
    try:
        os.write(fd2, struct.pack("<IiQ", 16, FUSE_NOTIFY_RESEND, 0))
        print("FUSE_NOTIFY_RESEND accepted")
    except OSError as e:
        print(f"FUSE_NOTIFY_RESEND refused: {e}")
        ok = False
    server = None
    if ok:
        unique, resend = serve(fd2)
        ok &= resend
        # The reader reads on to the end of the file: keep answering.
        server = os.fork()
        if server == 0:
            while True:
                serve(fd2, log=lambda *_: None)
    got = os.read(r, 64).decode()
    os.waitpid(reader, 0)
    if server:
        os.kill(server, signal.SIGKILL)
        os.waitpid(server, 0)
    print(f"the reader: {got}")
    ok &= got == "OK"
    subprocess_umount(mnt)
    os.kill(keeper, signal.SIGKILL)
    os.waitpid(keeper, 0)
    os.rmdir(mnt)
    print("takeover with RESEND works on this kernel" if ok else "takeover FAILED")
    return 0 if ok else 1


def subprocess_umount(mnt):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(mnt.encode(), 2)  # MNT_DETACH


if __name__ == "__main__":
    sys.exit(main())
