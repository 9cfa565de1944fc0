#!/usr/bin/env bash
# The fresh-machine check: what a new user gets on a minimal Debian 12.
#  1. mmdebstrap builds a minimal bookworm root (variant minbase: essential packages and apt,
#     nothing else) from this host's apt sources;
#  2. a clean clone of this repository's HEAD (committed work only) is copied into it;
#  3. inside it, under bubblewrap (its own /, /proc, /dev, /tmp; the host's network; an empty
#     environment), the README's commands run as root: `scripts/demo.sh` — set-up (Debian packages,
#     the pinned Python packages, the build), the corpus, a training run of configs/tiny.yaml on
#     8 ranks with checkpoints (30 of its 200 steps), `fp8moe ckpt verify`, a sample — stopping at
#     the first error.
# The host needs mmdebstrap, bubblewrap and git (as root: apt-get install mmdebstrap bubblewrap).
# No CUDA toolkit is inside, so the build is the CPU backend's, as on a new user's machine.
#
# usage: scripts/fresh-check.sh [WORKDIR]   (default: a new directory under /var/tmp, removed on
#        success, kept on failure)
# Exit 0 when every command succeeded; the log is WORKDIR/fresh-check.log. Measured: 342 s on a
# 2-core machine (README, "The fresh-machine check"). The root is built from the host's apt
# sources when they are Debian 12's (bookworm), else from FRESH_CHECK_SOURCES: a sources.list or
# deb822 .sources file of Debian 12 mirrors.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# All in one function, read whole before it runs: editing this file during a run cannot change it.
main() {
  for tool in mmdebstrap bwrap git; do
    command -v "$tool" >/dev/null || { echo "fresh-check: needs $tool (apt-get install mmdebstrap bubblewrap git)" >&2; exit 2; }
  done
  if [[ $(id -u) -ne 0 ]]; then
    echo "fresh-check: run as root (mmdebstrap's root mode and apt inside the sandbox need it)" >&2
    exit 2
  fi
  sources=${FRESH_CHECK_SOURCES:-/etc/apt/sources.list.d/debian.sources}
  [[ -f $sources ]] || sources=/etc/apt/sources.list
  [[ -f $sources ]] && grep -qw bookworm "$sources" || {
    echo "fresh-check: $sources names no bookworm (Debian 12) suite; set FRESH_CHECK_SOURCES to a sources file that does" >&2
    exit 2
  }
  # Namespaces: mmdebstrap's root mode mounts, bubblewrap makes namespaces (a VM, or a privileged
  # container; an ordinary Docker container refuses both).
  bwrap --bind / / --unshare-pid --proc /proc true 2>/dev/null ||
    { echo "fresh-check: bubblewrap cannot make namespaces here (needs a VM or a privileged container)" >&2; exit 2; }

  keep=${1:+yes}
  work=${1:-$(mktemp -d /var/tmp/fp8moe-fresh-XXXXXX)}
  mkdir -p "$work"
  work=$(cd "$work" && pwd)
  root=$work/root log=$work/fresh-check.log
  [[ ! -e $root ]] || { echo "fresh-check: $root exists; give an empty WORKDIR" >&2; exit 2; }
  : >"$log"
  say() { echo "fresh-check: $*" | tee -a "$log"; }
  start=$SECONDS
  phase=$start
  lap() { local now=$SECONDS; say "$1: $((now - phase)) s"; phase=$now; }

  say "building a minimal Debian 12 root in $root (mmdebstrap --variant=minbase bookworm)"
  mmdebstrap --variant=minbase --mode=root --quiet bookworm "$root" "$sources" >>"$log" 2>&1 ||
    { say "FAILED: mmdebstrap (see $log; kept: $work)"; exit 1; }
  lap "minimal root"

  commit=$(git -C "$repo" rev-parse HEAD)
  git clone --quiet --no-hardlinks "$repo" "$root/root/fp8moe"
  git -C "$root/root/fp8moe" checkout --quiet --detach "$commit"
  rm -rf "$root/root/fp8moe/.git"  # a downloaded release has none; nothing may depend on it
  say "clean clone of $commit copied in"

  # bubblewrap: the root as / (its own /tmp), fresh /proc and /dev (with /dev/shm for Open MPI), the
  # host's resolver; every capability kept (a root user on their own machine: apt drops to _apt); an
  # empty environment.
  bw=(--bind "$root" / --proc /proc --dev /dev --perms 1777 --tmpfs /dev/shm --ro-bind /etc/resolv.conf /etc/resolv.conf
      --unshare-pid --unshare-ipc --die-with-parent --cap-add ALL --chdir /root/fp8moe)
  envs=(HOME=/root LANG=C.UTF-8 TERM=dumb PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
  # The host's network settings come along, nothing else: its proxy variables, and where the host
  # trusts a local CA (a TLS-intercepting proxy, as on the machines this project is developed on),
  # that CA for pip inside.
  for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
    [[ -z ${!v:-} ]] || envs+=("$v=${!v}")
  done
  ca=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
  if [[ -f $ca ]]; then
    bw+=(--ro-bind "$ca" /etc/fresh-check-host-ca.crt)
    envs+=(PIP_CERT=/etc/fresh-check-host-ca.crt SSL_CERT_FILE=/etc/fresh-check-host-ca.crt)
  fi
  sandbox=(bwrap "${bw[@]}" /usr/bin/env -i "${envs[@]}")
  # 30 of tiny.yaml's 200 steps (checkpoints at 15 and 30): the same path through set-up, data,
  # every layout's communication, checkpoints, verify and a sample, in a seventh of the training
  # time (200 steps on 8 oversubscribed ranks took 635 s of this 2-core VM on 2026-12-01).
  demo_args="--set train.steps=30 --set train.warmup_steps=5 --set checkpoint.every=15"
  say "inside: scripts/demo.sh $demo_args (set-up, corpus, 30 steps on 8 ranks, ckpt verify, a sample)"
  if ! "${sandbox[@]}" /bin/bash -euo pipefail -c "scripts/demo.sh $demo_args" >>"$log" 2>&1; then
    say "FAILED inside the fresh root after $((SECONDS - start)) s (kept: $work); the last lines of $log:"
    tail -25 "$log" | grep -v '^fresh-check:'
    exit 1
  fi
  lap "set-up, build and the demo"
  grep -q ": valid: step .*every checksum matches" "$log" || { say "FAILED: no valid checkpoint reported by ckpt verify"; exit 1; }
  say "PASSED in $((SECONDS - start)) s (commit $commit)"
  [[ -n $keep ]] || rm -rf --one-file-system "$work"
}

main "$@"
exit
