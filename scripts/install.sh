#!/usr/bin/env bash
# Install hostagent on a Debian/Ubuntu KVM host, idempotently:
#   system packages (apt), a virtualenv under /opt/hostagent with the package, /usr/local/bin/hostagent,
#   a default /etc/hostagent/hostagent.toml (never overwritten) with a fresh operator token,
#   the systemd unit, /etc/modules-load.d/hostagent-vfio.conf; then it PRINTS the kernel parameters still
#   needed for the IOMMU (it never edits the bootloader).
#
#   scripts/install.sh [--root DIR] [--prefix /opt/hostagent] [--no-apt] [--no-systemctl] [--start]
#                      [--system-site-packages] [--offline]
#
# --root DIR installs into DIR as if it were / (DESTDIR-style: links and the unit name the final paths), for
# packaging and tests; it implies nothing else. --offline installs the package without fetching anything
# (dependencies must already be importable: use with --system-site-packages).
set -euo pipefail

root=""
prefix=/opt/hostagent
do_apt=1
do_systemctl=1
do_start=0
site_packages=0
offline=0
src=$(cd "$(dirname "$0")/.." && pwd)

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root=${2:?--root needs a directory}; shift 2 ;;
    --root=*) root=${1#*=}; shift ;;
    --prefix) prefix=${2:?--prefix needs a path}; shift 2 ;;
    --prefix=*) prefix=${1#*=}; shift ;;
    --no-apt) do_apt=0; shift ;;
    --no-systemctl) do_systemctl=0; shift ;;
    --start) do_start=1; shift ;;
    --system-site-packages) site_packages=1; shift ;;
    --offline) offline=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
root=${root:-${DESTDIR:-}}
root=${root%/}
case "$prefix" in /*) ;; *) echo "install.sh: --prefix must be absolute" >&2; exit 2 ;; esac

say() { printf 'hostagent install: %s\n' "$*"; }
need_root() {
  if [ -z "$root" ] && [ "$(id -u)" -ne 0 ]; then echo "install.sh: run as root (or use --root DIR)" >&2; exit 1; fi
}
need_root

# -- 1. system packages --------------------------------------------------------------------------------------------
if [ "$do_apt" = 1 ]; then
  pkgs=(python3 python3-venv python3-dev gcc pkg-config libvirt-dev libvirt-daemon-system qemu-system-x86 pci.ids kmod libudev1)
  missing=()
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    say "system packages present"
  fi
fi

# -- 2. virtualenv + package -----------------------------------------------------------------------------------------
venv="$root$prefix"
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  say "creating virtualenv $prefix"
  mkdir -p "$(dirname "$venv")"
  if [ "$site_packages" = 1 ]; then "$python" -m venv --system-site-packages "$venv"; else "$python" -m venv "$venv"; fi
fi
# Reinstall only when the source changed (a stamp of the package's files), so a second run is a no-op.
stamp_value=$(cd "$src" && { cat pyproject.toml; find hostagent templates -type f \( -name '*.py' -o -name '*.html' \
  -o -name '*.js' -o -name '*.css' -o -name '*.ini' -o -name '*.mako' \) -print0 | sort -z | xargs -0 sha256sum; } \
  | sha256sum | cut -c1-32)
stamp="$venv/.hostagent-installed"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$stamp_value" ]; then
  build=$(mktemp -d)
  trap 'rm -rf "$build"' EXIT
  # build from a clean copy: the checkout may hold caches, venvs and state that do not belong in a wheel
  (cd "$src" && tar --exclude='./.venv' --exclude='./.git' --exclude='./artifacts' --exclude='./state' \
      --exclude='*/__pycache__' --exclude='./build' --exclude='*.egg-info' -cf - .) | (cd "$build" && tar -xf -)
  # the package's templates are a symlink to the top-level templates/; a wheel needs real files
  if [ -L "$build/hostagent/web/templates" ]; then
    rm "$build/hostagent/web/templates"
    cp -r "$build/templates" "$build/hostagent/web/templates"
  fi
  pip_args=(-q --disable-pip-version-check --no-warn-script-location)
  if [ "$offline" = 1 ]; then
    pip_args+=(--no-index --no-deps --no-build-isolation)
    if ! "$venv/bin/python" -c 'import setuptools, wheel' 2>/dev/null; then
      echo "install.sh: --offline builds with the setuptools and wheel already importable; install python3-wheel" >&2
      exit 1
    fi
  fi
  say "installing the hostagent package into $prefix"
  "$venv/bin/python" -m pip install "${pip_args[@]}" "$build"
  echo "$stamp_value" > "$stamp"
else
  say "package up to date in $prefix"
fi
mkdir -p "$root/usr/local/bin"
ln -sfn "$prefix/bin/hostagent" "$root/usr/local/bin/hostagent"

# -- 3. configuration (never overwritten) --------------------------------------------------------------------------
etc="$root/etc/hostagent"
mkdir -p "$etc"
chmod 0750 "$etc"
conf="$etc/hostagent.toml"
token_file="$etc/operator.token"
if [ ! -e "$conf" ]; then
  token="op_$("$venv/bin/python" -c 'import secrets; print(secrets.token_urlsafe(32))')"
  digest=$(printf '%s' "$token" | sha256sum | cut -d' ' -f1)
  umask 077
  printf '%s\n' "$token" > "$token_file"
  cat > "$conf" <<CONF
# hostagent configuration (written once by scripts/install.sh; edit freely, install.sh never overwrites it).
# Every key and its default: docs/configuration.md.

[agent]
listen = "127.0.0.1"   # loopback only; set tls_cert/tls_key before listening elsewhere
port = 8470
state_dir = "/var/lib/hostagent"

[libvirt]
uri = "qemu:///system"

[store]
# url = "mysql+pymysql://hostagent:PASSWORD@db.example/hostagent"   # default: SQLite in state_dir

[reclaim]
enabled = true
check_interval_s = 3600
grace_s = 1200

[auth]
# SHA-256 of the operator token kept in /etc/hostagent/operator.token (dashboard login, operator API calls)
operator_token_sha256 = "$digest"
CONF
  umask 022
  chmod 0640 "$conf"
  say "wrote $conf (operator token in ${token_file#"$root"}, mode 0600)"
else
  say "kept existing ${conf#"$root"}"
fi

# -- 4. systemd unit, modules, state -------------------------------------------------------------------------------
install_file() {  # install_file SRC DEST MODE: copy only when different (idempotent, and says so)
  if [ -f "$2" ] && cmp -s "$1" "$2"; then say "unchanged ${2#"$root"}"; return 1; fi
  mkdir -p "$(dirname "$2")"
  install -m "$3" "$1" "$2"
  say "installed ${2#"$root"}"
}
unit_changed=0
# ExecStart names /usr/local/bin/hostagent, the link above, whatever --prefix is
install_file "$src/systemd/hostagent.service" "$root/etc/systemd/system/hostagent.service" 0644 && unit_changed=1
mods=$(mktemp)
printf '# loaded at boot for hostagent: the agent runs with ProtectKernelModules=yes and cannot load them itself\nvfio-pci\nvfio_iommu_type1\n' > "$mods"
install_file "$mods" "$root/etc/modules-load.d/hostagent-vfio.conf" 0644 || true
rm -f "$mods"
mkdir -p "$root/var/lib/hostagent"
chmod 0700 "$root/var/lib/hostagent"

if [ -z "$root" ] && [ "$do_systemctl" = 1 ]; then
  modprobe vfio-pci 2>/dev/null && modprobe vfio_iommu_type1 2>/dev/null || say "could not load vfio modules now (they load at next boot)"
  systemctl daemon-reload
  systemctl enable hostagent.service >/dev/null
  if [ "$do_start" = 1 ]; then
    if [ "$unit_changed" = 1 ]; then systemctl restart hostagent.service; else systemctl start hostagent.service; fi
    say "hostagent.service started"
  else
    say "enabled hostagent.service; start it with: systemctl start hostagent"
  fi
fi

# -- 5. kernel parameters (printed, never written) -----------------------------------------------------------------
cpuinfo=${HOSTAGENT_CPUINFO:-/proc/cpuinfo}
cmdline=${HOSTAGENT_CMDLINE:-/proc/cmdline}
vendor=$(grep -m1 '^vendor_id' "$cpuinfo" 2>/dev/null | awk '{print $3}' || true)
case "$vendor" in
  GenuineIntel) wanted="intel_iommu=on iommu=pt" ;;
  AuthenticAMD) wanted="amd_iommu=on iommu=pt" ;;
  *) wanted="" ;;
esac
current=" $(cat "$cmdline" 2>/dev/null || true) "
if [ -z "$wanted" ]; then
  say "unknown CPU vendor '${vendor:-?}': enable the IOMMU as your platform documents (iommu=pt)"
else
  missing_params=""
  for p in $wanted; do
    case "$current" in *" $p "*) ;; *) missing_params="$missing_params $p" ;; esac
  done
  if [ -n "$missing_params" ]; then
    say "kernel parameters still needed:${missing_params}"
    say "  add them to GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub, and reboot (not done for you)"
  else
    say "kernel parameters already set: $wanted"
  fi
fi
say "done. Check the host with: hostagent doctor"
