#!/usr/bin/env bash
# Install what hostagent needs on Debian/Ubuntu, idempotently: `deps.sh runtime` (the agent and its demo) or
# `deps.sh test` (also libvirtd, QEMU, busybox, MariaDB, Chromium for the test suite). Creates ./.venv.
set -euo pipefail
mode=${1:-runtime}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

sudo_() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_pkgs=(pkg-config libvirt-dev gcc pci.ids kmod libudev1)
if [ "$mode" = test ]; then
  apt_pkgs+=(libvirt-daemon-system libvirt-daemon-driver-qemu qemu-system-x86 qemu-utils busybox-static cpio
             chromium mariadb-server mariadb-client systemd iproute2 xz-utils zstd)
fi
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then missing+=(python3-venv python3-dev); fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: apt-get install ${missing[*]}"
  sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive sudo_ apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
extras="guest"
[ "$mode" = test ] && extras="guest,test"
stamp=".venv/.hostagent-$mode-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip wheel >/dev/null
  .venv/bin/python -m pip install -q -e ".[$extras]"
  touch "$stamp"
fi

if [ "$mode" = test ]; then
  # The real MariaDB the store tests use: start it if installed but stopped.
  if ! mariadb-admin ping >/dev/null 2>&1; then
    sudo_ start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
    for _ in $(seq 1 30); do mariadb-admin ping >/dev/null 2>&1 && break; sleep 1; done
  fi
  mariadb-admin ping >/dev/null 2>&1 || { echo "deps: MariaDB did not start" >&2; exit 1; }
  # Kernel + initramfs for the real vfio-pci tests in a QEMU guest.
  if [ -x scripts/build-test-guest.sh ]; then bash scripts/build-test-guest.sh; fi
fi
