#!/usr/bin/env bash
# A blended data.path ([[0.7, licences], [0.3, fortunes]], byte-level) end to end:
#  - one rank and two data-parallel ranks train on the same samples (recipe off: losses within
#    5e-7 relative over 40 steps; measured 4.0e-8 (2-core VM, 2026-12-01), and the layout tests
#    measured up to 4.7e-7 over 20 steps; a data set sampled on one layout only differs at once);
#  - a run resumed from its step-20 checkpoint repeats the uninterrupted run's losses bit for bit;
#  - the blend matters: the same run on the licences alone has other losses.
#
# usage: data_blend.sh FP8MOE MPIEXEC
set -uo pipefail
exe=$1 mpiexec=$2
source "$(dirname "$0")/common.sh"
tmp=$(mktemp -d /tmp/fp8moe-blend-XXXXXX)
ompi_session_dir "$tmp"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

prepare_licence_data "$exe" "$tmp/data/lic" || fail "prepare-data (licences)"
mapfile -t fortunes < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort | head -3)
((${#fortunes[@]} > 0)) || fail "no fortune files in /usr/share/games/fortunes (Debian package fortunes)"
"$exe" prepare-data --output "$tmp/data/fort" --split-on % --val-fraction 0.1 --input "${fortunes[@]}" >/dev/null ||
  fail "prepare-data (fortunes)"
small_moe_config "$tmp/cfg.yaml" "$tmp/data/lic" 40 20 "{dir: $tmp/ckpt, every: 20, keep_last: 3}"
blend="data.path=[[0.7, $tmp/data/lic.train], [0.3, $tmp/data/fort.train]]"
vblend="data.valid_path=[[1, $tmp/data/lic.val], [1, $tmp/data/fort.val]]"
train() {  # RANKS LOG --set ...
  local n=$1 log=$2
  shift 2
  "$mpiexec" -n "$n" "$exe" train "$tmp/cfg.yaml" --set fp8.recipe=off --set "$blend" --set "$vblend" "$@" >"$log" 2>&1 ||
    fail "$n-rank run: $(tail -5 "$log")"
  loss_bits <"$log" >"$log.bits"
}

train 1 "$tmp/one.txt" --set checkpoint.dir="$tmp/ckpt1"
grep -q "valid_path:" "$tmp/one.txt" || fail "the effective config does not show data.valid_path"
(($(wc -l <"$tmp/one.txt.bits") == 40)) || fail "not 40 losses: $(tail -5 "$tmp/one.txt")"
train 2 "$tmp/two.txt" --set checkpoint.dir="$tmp/ckpt2"
# The bits (%a) as decimals (bash's printf reads hex floats; awk may not), then the worst step.
decimal() { while read -r step bits; do printf '%s %.17g\n' "$step" "$bits"; done <"$1"; }
worst=$(paste <(decimal "$tmp/one.txt.bits") <(decimal "$tmp/two.txt.bits") | awk '
  { d = ($2 > $4 ? $2 - $4 : $4 - $2) / $2; if ($1 != $3 || $2 + 0 <= 0) d = 1; if (d > w) w = d }
  END { if (NR != 40) w = 1; printf "%.2e", w }')
[[ $worst =~ ^[0-9] ]] && awk -v w="$worst" 'BEGIN { exit !(w <= 5e-7) }' ||
  fail "1 rank vs 2 data-parallel ranks: worst relative loss difference $worst"

# Resume from the step-20 checkpoint of the 1-rank run (its `latest` names step 40: the path is given).
train 1 "$tmp/resumed.txt" --set checkpoint.dir="$tmp/ckpt3" --set checkpoint.resume="$tmp/ckpt1/step_00000020"
grep -q "resumed from $tmp/ckpt1/step_00000020: step 20" "$tmp/resumed.txt" || fail "did not resume from step 20"
sed -n '21,40p' "$tmp/one.txt.bits" | diff -q - "$tmp/resumed.txt.bits" >/dev/null ||
  fail "resumed losses differ: $(sed -n '21,40p' "$tmp/one.txt.bits" | diff - "$tmp/resumed.txt.bits" | head -4)"

train 1 "$tmp/lic.txt" --set checkpoint.dir="$tmp/ckpt4" --set "data.path=$tmp/data/lic.train"
cmp -s "$tmp/one.txt.bits" "$tmp/lic.txt.bits" && fail "the blend trains on the same samples as the licences alone"
echo "data_blend: [[0.7, licences], [0.3, fortunes]]: 1 rank vs 2 data-parallel ranks within $worst relative;" \
  "resumed at step 20: steps 21-40 bitwise equal; differs from the licences alone"
