#!/usr/bin/env bash
# A real single-host OpenPBS (server, scheduler, comm and MoM on this machine; queue `workq`)
# for hpctrial's `pbs` test tier, built from OpenPBS's source and installed once per machine.
# Needs root (PBS's daemons run as root) and Debian's apt repository for the build's packages.
# PBS runs no job as root: jobs are submitted as the ordinary user HPCTRIAL_PBS_USER.
#
#   scripts/local-pbs.sh start [TARBALL]     build and install when needed, start, wait until the
#                                            node is free; prints PBS_EXEC=... and PBS_USER=...
#   scripts/local-pbs.sh stop                stop the daemons (the installation stays)
#   scripts/local-pbs.sh status              exit 0 when the server answers
#   scripts/local-pbs.sh test-setup [TARBALL]  start when root and a PBS or its source is there;
#                                            otherwise say why not and exit 0 (the pbs tests
#                                            then skip with that reason)
#
# The source: TARBALL, or $HPCTRIAL_OPENPBS_TARBALL, or ../shared/tools/openpbs/openpbs.tar.gz
# beside this checkout (an archive of github.com/openpbs/openpbs whose top folder is openpbs/).
# Without one, and with no PBS installed, nothing is installed and the script says so.
# HPCTRIAL_PBS_PREFIX (default /opt/pbs) is where it is installed, HPCTRIAL_PBS_WORK (default
# /var/tmp/hpctrial-openpbs) where it is built, HPCTRIAL_PBS_USER (default pbsuser) the user.
set -euo pipefail

action=${1:-}
root=$(cd "$(dirname "$0")/.." && pwd)
prefix=${HPCTRIAL_PBS_PREFIX:-/opt/pbs}
work=${HPCTRIAL_PBS_WORK:-/var/tmp/hpctrial-openpbs}
user=${HPCTRIAL_PBS_USER:-pbsuser}
home=/var/spool/pbs
stamp=$prefix/.hpctrial-installed

die() { echo "local-pbs: $*" >&2; exit 1; }
say() { echo "local-pbs: $*" >&2; }

tarball() {
  local t=${1:-${HPCTRIAL_OPENPBS_TARBALL:-}}
  if [[ -z $t && -f $root/../shared/tools/openpbs/openpbs.tar.gz ]]; then
    t=$(cd "$root/../shared/tools/openpbs" && pwd)/openpbs.tar.gz
  fi
  echo "$t"
}

installed() { [[ -x $prefix/sbin/pbs_server && -x $prefix/bin/qsub && -f /etc/pbs.conf ]]; }

# `/etc/init.d/pbs status` exits 0 even when nothing runs: read what it says.
daemons() { if [[ -x /etc/init.d/pbs ]]; then /etc/init.d/pbs status 2>/dev/null || true; fi; }
daemon_up() { case "$(daemons)" in *"$1 is pid "*) return 0 ;; *) return 1 ;; esac; }
answers() { PATH=$prefix/bin:$PATH timeout 10 qstat -B >/dev/null 2>&1; }

build_and_install() {
  local source=$1 packages missing src=$work/openpbs
  # The build's packages (OpenPBS's INSTALL for Debian, without sendmail and sudo).
  packages="iproute2 gcc g++ make libtool autoconf automake pkg-config perl swig libhwloc-dev
    libx11-dev libxt-dev libedit-dev libical-dev libncurses-dev postgresql-server-dev-all
    postgresql-contrib postgresql python3 python3-dev tcl-dev tk-dev tcl tk libexpat1-dev expat
    libssl-dev libxext-dev libxft-dev libcjson-dev libcjson1 libedit2 libical3"
  missing=$(for p in $packages; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
  done)
  if [[ -n $missing ]]; then
    say "installing OpenPBS's build packages: ${missing//$'\n'/ }"
    apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  fi
  if [[ ! -f $src/configure.ac ]]; then
    install -d -m 0755 "$work"
    tar -xzf "$source" -C "$work"
    [[ -f $src/configure.ac ]] || die "$source holds no openpbs/configure.ac: not OpenPBS's source"
  fi
  say "building OpenPBS from $source in $src (once per machine)"
  (
    cd "$src"
    # Debian's python: configure links pbs_server with the first python on PATH, and a pyenv or
    # conda one would be gone for the server later.
    # shellcheck disable=SC2030  # for the build alone
    export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin PYTHON=/usr/bin/python3
    unset PYENV_VERSION PYTHONPATH PYTHONHOME VIRTUAL_ENV CONDA_PREFIX
    [[ -x configure ]] || ./autogen.sh >"$work/autogen.log" 2>&1 || die "autogen failed; see $work/autogen.log"
    if ! grep -qs "^prefix = $prefix\$" Makefile; then
      ./configure --prefix="$prefix" >"$work/configure.log" 2>&1 || die "configure failed; see $work/configure.log"
    fi
    make -j"$(nproc)" >"$work/make.log" 2>&1 || die "make failed; see $work/make.log"
    make install >"$work/install.log" 2>&1 || die "make install failed; see $work/install.log"
  )
  [[ -f /etc/pbs.conf && -d $home/server_priv ]] || "$prefix/libexec/pbs_postinstall" >/dev/null
  # Ordinary users' qsub and qstat authenticate through these.
  chmod 4755 "$prefix/sbin/pbs_iff" "$prefix/sbin/pbs_rcp"
  sha256sum "$source" | cut -d' ' -f1 >"$stamp"
}

# PBS refuses a host name that resolves to a loopback address ("Could not find any usable IP
# address for host"), which Debian and containers give the host name: PBS gets a name of its own
# for this host's first global IPv4 address, and the host name resolves as before.
pbs_host() {
  local host ip
  host=$(hostname)
  if getent ahostsv4 "$host" | awk '{print $1}' | grep -qv '^127\.'; then
    echo "$host"
    return
  fi
  ip=$(ip -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -1)
  [[ -n $ip ]] || die "this host has no IPv4 address but loopback: PBS cannot run here"
  grep -q "[[:space:]]pbshost\$" /etc/hosts || echo "$ip pbshost" >>/etc/hosts
  echo pbshost
}

configure() {
  local name=$1 key value momconf=$home/mom_priv/config
  for pair in "PBS_SERVER=$name" "PBS_SERVER_HOST_NAME=$name" "PBS_LEAF_NAME=$name" \
              "PBS_MOM_NODE_NAME=$(hostname)" PBS_START_SERVER=1 PBS_START_SCHED=1 PBS_START_COMM=1 \
              PBS_START_MOM=1; do
    key=${pair%%=*}
    value=${pair#*=}
    if grep -q "^$key=" /etc/pbs.conf; then sed -i "s|^$key=.*|$key=$value|" /etc/pbs.conf; else echo "$pair" >>/etc/pbs.conf; fi
  done
  # The MoM's server, and output files copied with cp (scp to user@host needs ssh keys; without
  # either, a job's output copy fails and the job stays in state E). The $ is the MoM's own.
  # shellcheck disable=SC2016
  if grep -q '^\$clienthost' "$momconf"; then
    sed -i "s|^\$clienthost .*|\$clienthost $name|" "$momconf"
  else
    echo "\$clienthost $name" >>"$momconf"
  fi
  # shellcheck disable=SC2016
  grep -q '^\$usecp' "$momconf" || echo '$usecp *:/ /' >>"$momconf"
}

start() {
  local source name
  [[ $(id -u) -eq 0 ]] || die "needs root (PBS's daemons run as root)"
  if ! installed; then
    source=$(tarball "${1:-}")
    [[ -n $source ]] || die "no OpenPBS installed under $prefix and no source to build it from: pass the source" \
      "archive (github.com/openpbs/openpbs) as an argument or in HPCTRIAL_OPENPBS_TARBALL"
    [[ -f $source ]] || die "no OpenPBS source at $source"
    build_and_install "$source"
  fi
  name=$(pbs_host)
  configure "$name"
  if ! answers || ! daemon_up pbs_mom || ! daemon_up pbs_sched || ! daemon_up pbs_comm; then
    /etc/init.d/pbs start >/dev/null 2>&1 || true
  fi
  for _ in $(seq 60); do answers && break; sleep 1; done
  answers || die "the PBS server does not answer; see $home/server_logs"
  daemon_up pbs_mom || die "pbs_mom is not running; see $home/mom_logs"
  # shellcheck disable=SC2031  # the build's PATH was its own
  export PATH=$prefix/bin:$prefix/sbin:$PATH
  qmgr -c "list node $name" >/dev/null 2>&1 || qmgr -c "create node $name"
  qstat -Q workq >/dev/null 2>&1 || qmgr -c "create queue workq queue_type=execution,enabled=true,started=true"
  qmgr -c "set server default_queue = workq"
  qmgr -c "set server flatuid = true"
  qmgr -c "set server job_history_enable = true"
  qmgr -c "set server scheduler_iteration = 2"
  id "$user" >/dev/null 2>&1 || useradd -m -s /bin/bash "$user" || id "$user" >/dev/null  # the container test may make it too
  for _ in $(seq 60); do
    case "$(pbsnodes -a 2>&1)" in *'state = free'*) echo "PBS_EXEC=$prefix"; echo "PBS_USER=$user"; return 0 ;; esac
    sleep 1
  done
  die "the node did not become free: $(pbsnodes -a 2>&1 | grep -m1 'state =')"
}

case $action in
  start)
    start "${2:-}"
    ;;
  test-setup)
    if [[ $(id -u) -ne 0 ]]; then
      echo "local-pbs: not root, so no local PBS; the pbs tests will skip"
      exit 0
    fi
    if ! installed && [[ -z $(tarball "${2:-}") ]]; then
      echo "local-pbs: no OpenPBS installed and no source to build it from" \
           "(HPCTRIAL_OPENPBS_TARBALL); the pbs tests will skip"
      exit 0
    fi
    start "${2:-}"
    ;;
  stop)
    if [[ -x /etc/init.d/pbs ]]; then /etc/init.d/pbs stop >/dev/null 2>&1 || true; fi
    ;;
  status)
    installed && answers
    ;;
  *)
    echo "usage: $0 start|stop|status|test-setup [TARBALL]" >&2
    exit 2
    ;;
esac
