#!/usr/bin/env bash
# Build the QEMU test guest used by tests/e2e: Debian's real kernel + its modules, and a tiny busybox initramfs
# that mounts the host's / over 9p and switch_roots into it (see tests/support/qemu.py for the second stage).
#
# Output (idempotent; a second run with nothing changed returns at once):
#   .cache/testguest/vmlinuz                   the kernel of linux-image-<ver>-amd64 (downloaded, never installed)
#   .cache/testguest/modules/lib/modules/<v>/  every module of that package, with modules.dep (depmod)
#   .cache/testguest/initramfs.cpio.gz         busybox-static + the modules needed to mount 9p
#   .cache/testguest/kernel-release            <v>, which tests/support/qemu.py reads
#   .cache/testguest/ready                     stamp: package version + hash of this script
# Needs: apt (apt-get download), dpkg-deb, kmod (depmod, modprobe), busybox-static, cpio, gzip.
# HOSTAGENT_TESTGUEST_DEB=/path/linux-image-...deb uses a local package instead of downloading one.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out="$repo/.cache/testguest"
mkdir -p "$out"

die() { echo "build-test-guest: $*" >&2; exit 1; }
for tool in dpkg-deb depmod modprobe cpio gzip; do
  command -v "$tool" >/dev/null || die "missing $tool (apt-get install dpkg kmod cpio gzip)"
done
# The initramfs has no libc: its busybox must be the static build (Debian's busybox-static, /bin/busybox).
busybox=/bin/busybox
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "install ok installed" \
  || die "missing busybox-static (apt-get install busybox-static)"
"$busybox" --list | grep -qx switch_root || die "$busybox has no switch_root applet"

script_hash=$(sha256sum "$0" | cut -c1-16)

# Which real kernel package does the linux-image-amd64 metapackage point at?
if [ -n "${HOSTAGENT_TESTGUEST_DEB:-}" ]; then
  deb_src=$HOSTAGENT_TESTGUEST_DEB
  [ -f "$deb_src" ] || die "HOSTAGENT_TESTGUEST_DEB=$deb_src does not exist"
  pkg=$(dpkg-deb -f "$deb_src" Package)
  version=$(dpkg-deb -f "$deb_src" Version)
else
  deb_src=
  resolve() { apt-cache depends --important linux-image-amd64 2>/dev/null \
                | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }'; }
  pkg=$(resolve || true)
  if [ -z "$pkg" ]; then
    # A cached build is still usable offline.
    if [ -f "$out/ready" ] && grep -q " $script_hash\$" "$out/ready"; then
      echo "build-test-guest: apt does not know linux-image-amd64 (offline?);" \
           "using the cached $(cat "$out/kernel-release")"
      exit 0
    fi
    apt-get update -qq || die "apt-get update failed"
    pkg=$(resolve) || true
    [ -n "$pkg" ] || die "apt knows no linux-image-amd64 (add a Debian main repository)"
  fi
  version=$(apt-cache policy "$pkg" | awk '$1 == "Candidate:" { print $2 }')
fi
stamp="$pkg $version $script_hash"
if [ -f "$out/ready" ] && [ "$(cat "$out/ready")" = "$stamp" ] && [ -f "$out/vmlinuz" ] \
   && [ -f "$out/initramfs.cpio.gz" ]; then
  echo "build-test-guest: up to date ($stamp)"
  exit 0
fi
echo "build-test-guest: building $pkg $version into $out"
rm -f "$out/ready"

work=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT
if [ -n "$deb_src" ]; then
  cp "$deb_src" "$work/"
else
  # apt-get download drops privileges to _apt, which cannot write a root-owned mktemp dir.
  if id _apt >/dev/null 2>&1; then chown _apt "$work"; fi
  (cd "$work" && apt-get download -q "$pkg=$version") || die "apt-get download $pkg=$version failed"
fi
deb=$(ls "$work"/*.deb)
dpkg-deb -x "$deb" "$work/x"
krel=$(ls "$work/x/lib/modules")
[ "$(echo "$krel" | wc -l)" -eq 1 ] || die "expected one kernel release in $deb, found: $krel"
[ -f "$work/x/boot/vmlinuz-$krel" ] || die "no vmlinuz-$krel in $deb"
# Debian ships modules uncompressed in bookworm and xz/zstd-compressed later; kmod reads both, busybox insmod
# only plain ones, so the initramfs copies are decompressed.
depmod -b "$work/x" "$krel"

# The initramfs: busybox, the modules needed to reach the 9p root, and /init.
ir="$work/initramfs"
mkdir -p "$ir"/{bin,dev,proc,sys,newroot,lib/modules}
cp "$busybox" "$ir/bin/busybox"
: > "$ir/modules.load"
for mod in virtio_pci 9pnet_virtio 9p overlay; do
  modprobe -d "$work/x" -S "$krel" --show-depends "$mod" | while read -r verb path _; do
    [ "$verb" = insmod ] || continue  # 'builtin ...' lines need nothing
    name=$(basename "$path")
    base=${name%%.ko*}.ko
    grep -qx "$base" "$ir/modules.load" && continue
    case "$name" in
      *.ko.xz) xz -dc "$path" > "$ir/lib/modules/$base" ;;
      *.ko.zst) zstd -qdc "$path" > "$ir/lib/modules/$base" ;;
      *.ko.gz) gzip -dc "$path" > "$ir/lib/modules/$base" ;;
      *) cp "$path" "$ir/lib/modules/$base" ;;
    esac
    echo "$base" >> "$ir/modules.load"
  done
done
cat > "$ir/init" <<'EOF'
#!/bin/busybox sh
# Stage 1: load what 9p needs, mount the host's / (read-only) under a writable overlay, mount the per-run share
# at /run/hostagent-test, then switch_root and run the per-run second stage the test harness wrote there.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() { echo "hostagent-testguest: $*"; echo "HOSTAGENT-STAGE1-FAILED"; poweroff -f; }
for m in $(cat /modules.load); do insmod "/lib/modules/$m" || fail "insmod $m"; done
mkdir -p /lower /upper
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /lower || fail "mount hostroot"
# The overlay's upper layer is RAM: the guest may write anywhere, the host sees none of it.
mount -t tmpfs -o mode=755 tmpfs /upper || fail "tmpfs"
mkdir -p /upper/up /upper/work
mount -t overlay -o lowerdir=/lower,upperdir=/upper/up,workdir=/upper/work overlay /newroot || fail "overlay"
mount -t tmpfs -o mode=755 tmpfs /newroot/run || fail "tmpfs /run"
mkdir -p /newroot/run/hostagent-test
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 hostagent_test /newroot/run/hostagent-test \
  || fail "mount hostagent_test"
[ -f /newroot/run/hostagent-test/stage2.sh ] || fail "no stage2.sh in the per-run share"
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
exec switch_root /newroot /bin/sh /run/hostagent-test/stage2.sh
EOF
chmod 755 "$ir/init"
(cd "$ir" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) > "$work/initramfs.cpio.gz"

# Publish: modules tree (the guest's modprobe uses it), kernel, initramfs, then the stamp last.
rm -rf "$out/modules"
mkdir -p "$out/modules/lib/modules"
mv "$work/x/lib/modules/$krel" "$out/modules/lib/modules/$krel"
mv "$work/x/boot/vmlinuz-$krel" "$out/vmlinuz"
mv "$work/initramfs.cpio.gz" "$out/initramfs.cpio.gz"
echo "$krel" > "$out/kernel-release"
echo "$stamp" > "$out/ready"
echo "build-test-guest: ready: kernel $krel, $(wc -l < "$ir/modules.load") initramfs modules"
