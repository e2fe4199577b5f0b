export PATH=/usr/sbin:/usr/bin HOME=/root VM_INDEX VM_IP PEER_IP
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1

# The host reads the exit code from the share; the line on the console is for people.
finish() {
  cd /
  if grep -q ' /mnt ' /proc/mounts; then
    echo "$1" >"/mnt/vm$VM_INDEX.status"
    umount /mnt
  fi
  echo "softroce-vms: vm$VM_INDEX finished, exit $1"
  poweroff -f
}
# Before the share is mounted: the missing exit code tells the host.
fail() {
  echo "softroce-vms: vm$VM_INDEX: $*"
  poweroff -f
}

for module in $modules; do
  modprobe "$module" || fail "modprobe $module failed"
done
# virtio_net may register eth0 a moment after modprobe returns.
tries=0
until [ -e /sys/class/net/eth0 ]; do
  tries=$((tries + 1))
  [ "$tries" -le 50 ] || fail "no eth0 after 5 s"
  sleep 0.1
done
ip link set lo up
ip addr add "$VM_IP/24" dev eth0 || fail "ip addr add $VM_IP/24 dev eth0 failed"
ip link set eth0 up || fail "ip link set eth0 up failed"
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add rxe0 failed"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 share /mnt || fail "mounting the share failed"

cd /mnt
read -r uptime _ </proc/uptime
# Its time of change tells the host how long the boot took.
: >"/mnt/vm$VM_INDEX.started"
echo "softroce-vms: vm$VM_INDEX up after $uptime s, running vm$VM_INDEX.sh"
sh "/mnt/vm$VM_INDEX.sh"
finish $?
