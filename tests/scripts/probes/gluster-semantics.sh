#!/bin/bash
# What GlusterFS's native FUSE client gives the calls the shared backends
# make (issue #25), with two clients of one volume on this host:
#
#   unshare -m --propagation private tests/scripts/probes/gluster-semantics.sh   (as root;
#   needs Debian's glusterfs-server and glusterfs-client)
#
# flock and fcntl locks across clients, O_CREAT|O_EXCL across clients, a
# directory renamed into place, a file replaced by rename (how records are
# written), a loop device over an XFS image on the volume, inode numbers.
# A fact-finding probe for docs/design.md, not a test of the driver; it
# removes its volume, mounts and daemons when done.
set -u
B=/tmp/glprobe
rm -rf $B; mkdir -p $B/brick $B/m1 $B/m2
pgrep -x glusterd >/dev/null || glusterd --log-file=$B/glusterd.log
sleep 2
H=$(hostname)
gluster --mode=script volume create gprobe $H:$B/brick force >/dev/null && gluster --mode=script volume start gprobe >/dev/null || { echo "volume create/start failed"; exit 1; }
mount -t glusterfs $H:/gprobe $B/m1 && mount -t glusterfs $H:/gprobe $B/m2 || { echo mount failed; exit 1; }
echo "mounted: $(grep gprobe /proc/mounts | awk '{print $2, $3}' | tr '\n' ' ')"
# 1. flock across clients
python3 - $B <<'PY'
import fcntl, os, sys, time, subprocess
b = sys.argv[1]
open(f"{b}/m1/lockfile", "w").close()
f1 = open(f"{b}/m1/lockfile", "r+")
fcntl.flock(f1, fcntl.LOCK_EX | fcntl.LOCK_NB)
f2 = open(f"{b}/m2/lockfile", "r+")
try:
    fcntl.flock(f2, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("flock: a second client's LOCK_EX was GRANTED while the first holds it (no cross-client flock)")
except BlockingIOError:
    print("flock: a second client's LOCK_EX is refused while the first holds it (cross-client flock works)")
# fcntl (POSIX) locks
g1 = open(f"{b}/m1/plock", "w+"); g2 = open(f"{b}/m2/plock", "r+")
fcntl.lockf(g1, fcntl.LOCK_EX | fcntl.LOCK_NB)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    h = open(f"{b}/m2/plock", "r+")
    try:
        fcntl.lockf(h, fcntl.LOCK_EX | fcntl.LOCK_NB); os.write(w, b"GRANTED")
    except OSError:
        os.write(w, b"refused")
    os._exit(0)
os.waitpid(pid, 0)
print("fcntl lock from another process via the second client:", os.read(r, 16).decode())
# 2. O_EXCL across clients
try:
    os.close(os.open(f"{b}/m1/excl", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    os.close(os.open(f"{b}/m2/excl", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    print("O_EXCL: the second client's create SUCCEEDED (broken)")
except FileExistsError:
    print("O_EXCL: the second client's create is refused (EEXIST)")
# 3. rename a directory into place, seen by the other client at once
os.makedirs(f"{b}/m1/.pull-x/data"); open(f"{b}/m1/.pull-x/data/f", "w").write("sealed")
os.makedirs(f"{b}/m1/sources", exist_ok=True)
os.stat(f"{b}/m2/sources")
try:
    os.stat(f"{b}/m2/sources/x")
except FileNotFoundError:
    pass
os.rename(f"{b}/m1/.pull-x", f"{b}/m1/sources/x")
t0 = time.time()
try:
    data = open(f"{b}/m2/sources/x/data/f").read()
    print(f"rename: the other client reads the renamed tree at once: {data!r}")
except FileNotFoundError:
    print("rename: the other client does NOT see the renamed tree at once (negative entry cached)")
# 4. write then read across clients (close-to-open)
open(f"{b}/m1/seal.json", "w").write("v1")
print("read after the other client's close:", open(f"{b}/m2/seal.json").read())
open(f"{b}/m1/seal.tmp", "w").write("v2-whole"); os.rename(f"{b}/m1/seal.tmp", f"{b}/m1/seal.json")
print("read after the other client's rename over it:", open(f"{b}/m2/seal.json").read())
t0 = time.time()
while open(f"{b}/m2/seal.json").read() != "v2-whole" and time.time() - t0 < 10:
    time.sleep(0.05)
print(f"  ... the new content shows after {time.time() - t0:.2f} s")
# The same with a stat of the directory first (a reader that lists before it opens)
open(f"{b}/m1/seal.tmp", "w").write("v3"); os.rename(f"{b}/m1/seal.tmp", f"{b}/m1/seal.json")
os.listdir(f"{b}/m2")
print("after a readdir on the other client:", open(f"{b}/m2/seal.json").read())
PY
# 5. a loop device over an XFS image on Gluster, mounted ro,norecovery,nouuid
truncate -s 300M $B/m1/image.xfs && mkfs.xfs -q $B/m1/image.xfs
lo=$(losetup -f --show -r $B/m2/image.xfs) && mkdir -p $B/x && mount -t xfs -o ro,norecovery,nouuid $lo $B/x && echo "xfs image on gluster: loop $lo mounted ro,norecovery,nouuid" && umount $B/x; losetup -d $lo 2>/dev/null
stat -c 'inode numbers: %i (client 1)' $B/m1/image.xfs; stat -c 'inode numbers: %i (client 2)' $B/m2/image.xfs
umount $B/m1 $B/m2
gluster --mode=script volume stop gprobe >/dev/null; gluster --mode=script volume delete gprobe >/dev/null
pkill -f glusterfind; pkill -x glusterd; pkill -x glusterfsd; pkill -f "glusterfs.*gprobe"
rm -rf $B
