#!/bin/bash
# Stripe a Lustre directory of model shards over every OST, in 16 MiB stripes:
#
#   setup-striping.sh [--dry-run] [--migrate] [--count N] [--size SIZE] SHARD_DIR
#
# Why: a Lustre file lives on stripe_count OSTs (object storage targets), stripe_size bytes at a
# time round-robin. The default on most file systems (FSx for Lustre included) is 1 stripe of
# 1 MiB: a whole 10-GiB shard sits on one OST and every rank's readers queue on the same server.
# `-c -1` spreads each file over all OSTs, so the parallel reads of all ranks hit all OSTs at once;
# `-S 16M` is a multiple of every read gdsload issues (4 MiB kvikio tasks, 16 MiB pinned-ring
# chunks; GDSLOAD_CHUNK_BYTES) and equals cuFile's largest DMA (max_direct_io_size_kb in
# deploy/cufile/cufile.json), so a read is served by one OST (two where it crosses a stripe
# boundary) while a multi-GiB shard still spreads over every OST.
#
# `lfs setstripe` on a directory sets the layout of files created in it afterwards. This script
# therefore sets the directory and each existing subdirectory, checks the result, and then looks
# at the files already there: they keep their old layout. It lists them, and with --migrate
# re-stripes them in place (`lfs migrate`, which rewrites the data: slow for big files, and the
# files must not be open for writing). Best run on an empty directory, before writing the shards.
#
# Options:
#   --count N    stripe count, -1 = every OST (default -1)
#   --size SIZE  stripe size with a K/M/G suffix, a multiple of 64K (default 16M)
#   --migrate    re-stripe files that already exist with a different layout
#   --dry-run    print the lfs commands that would change something; change nothing
#
# Exit status: 0 done (files with the old layout are reported, not an error); 64 usage;
# 66 no such directory; 69 no lfs command; 70 the layout read back differs from the one set;
# 78 not a Lustre directory.
set -euo pipefail

readonly EX_USAGE=64 EX_NOINPUT=66 EX_UNAVAILABLE=69 EX_SOFTWARE=70 EX_CONFIG=78

die() {
    local code=$1
    shift
    printf 'setup-striping: %s\n' "$*" >&2
    exit "$code"
}

usage() {
    sed -n '3p' "$0" | sed 's/^#   //' >&2
    exit "$EX_USAGE"
}

# SIZE with an optional K/M/G suffix (binary units, like lfs) -> bytes.
size_bytes() {
    local n=${1%[KkMmGg]} unit=${1##*[0-9]}
    [[ $n =~ ^[0-9]+$ && ${#unit} -le 1 ]] || return 1
    case $unit in
        '') printf '%d\n' "$((10#$n))" ;;
        [Kk]) printf '%d\n' "$((10#$n << 10))" ;;
        [Mm]) printf '%d\n' "$((10#$n << 20))" ;;
        [Gg]) printf '%d\n' "$((10#$n << 30))" ;;
        *) return 1 ;;
    esac
}

run() {
    if [[ $dry_run -eq 1 ]]; then
        printf 'would run: %s\n' "$*"
    else
        printf 'running: %s\n' "$*"
        "$@"
    fi
}

count=-1
size=16M
dry_run=0
migrate=0
dir=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --count) [[ $# -ge 2 ]] || usage; count=$2; shift 2 ;;
        --size) [[ $# -ge 2 ]] || usage; size=$2; shift 2 ;;
        --migrate) migrate=1; shift ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage ;;
        -*) die "$EX_USAGE" "unknown option '$1'" ;;
        *) [[ -z $dir ]] || die "$EX_USAGE" "one SHARD_DIR only (got '$dir' and '$1')"; dir=$1; shift ;;
    esac
done
[[ -n $dir ]] || usage

# --- checks, before anything changes ---------------------------------------------------------
if [[ $count != -1 ]] && ! [[ $count =~ ^[0-9]+$ && $count -ge 1 && $count -le 2000 ]]; then
    die "$EX_USAGE" "--count '$count': use -1 (every OST) or 1..2000"
fi
if ! bytes=$(size_bytes "$size"); then
    die "$EX_USAGE" "--size '$size': use a number with an optional K, M or G suffix, e.g. 16M"
fi
if [[ $bytes -lt 65536 || $((bytes % 65536)) -ne 0 ]]; then
    die "$EX_USAGE" "--size '$size' ($bytes bytes): Lustre stripe sizes are multiples of 64K"
fi
command -v lfs >/dev/null ||
    die "$EX_UNAVAILABLE" "no 'lfs' command: install the Lustre client utilities on this host" \
        "(for FSx for Lustre: the lustre-client package that matches the kernel)"
[[ -d $dir ]] || die "$EX_NOINPUT" "'$dir' is not a directory"
lfs getstripe -d "$dir" >/dev/null 2>&1 ||
    die "$EX_CONFIG" "'$dir' is not on a Lustre file system ('lfs getstripe -d' failed):" \
        "striping applies to Lustre only; on other file systems there is nothing to do"

osts=$(lfs osts "$dir" | grep -cE '^[0-9]+: ' || true)
[[ $osts -ge 1 ]] || die "$EX_SOFTWARE" "'lfs osts $dir' lists no OST"
expected=$count
if [[ $count == -1 || $count -gt $osts ]]; then
    expected=$osts # what a file's stripe count reads back as: Lustre caps it at the OST count
fi
printf '%s: %d OSTs; target layout: stripe count %s, stripe size %s (%d bytes)\n' \
    "$dir" "$osts" "$count" "$size" "$bytes"
if [[ $osts -eq 1 ]]; then
    printf 'note: a single OST: striping cannot spread the load; add OSTs (FSx: more capacity)\n'
fi

# --- the directory and its subdirectories ----------------------------------------------------
mapfile -t dirs < <(find "$dir" -type d | LC_ALL=C sort)
for d in "${dirs[@]}"; do
    run lfs setstripe -c "$count" -S "$size" "$d"
done

if [[ $dry_run -eq 0 ]]; then
    for d in "${dirs[@]}"; do
        got_count=$(lfs getstripe -d -c "$d")
        got_size=$(lfs getstripe -d -S "$d")
        if [[ $got_count != "$count" || $got_size != "$bytes" ]]; then
            die "$EX_SOFTWARE" "'$d' reads back stripe count '$got_count', size '$got_size';" \
                "expected '$count', '$bytes' (is a parent's layout or a quota pool overriding it?)"
        fi
    done
    printf 'ok: %d director%s striped -c %s -S %s\n' "${#dirs[@]}" \
        "$([[ ${#dirs[@]} -eq 1 ]] && echo y || echo ies)" "$count" "$size"
fi

# --- files that already exist keep their layout ----------------------------------------------
mapfile -t files < <(find "$dir" -type f | LC_ALL=C sort)
stale=()
for f in "${files[@]}"; do
    if [[ $(lfs getstripe -c "$f") != "$expected" || $(lfs getstripe -S "$f") != "$bytes" ]]; then
        stale+=("$f")
    fi
done
if [[ ${#stale[@]} -eq 0 ]]; then
    printf 'ok: %d existing file(s), all striped over %d OSTs in %s stripes\n' "${#files[@]}" "$expected" "$size"
    exit 0
fi
if [[ $migrate -eq 0 ]]; then
    printf 'warning: %d existing file(s) keep their old layout (new files get the new one):\n' "${#stale[@]}" >&2
    printf '  %s\n' "${stale[@]}" >&2
    printf 're-run with --migrate to re-stripe them in place, or copy them in again\n' >&2
    exit 0
fi
for f in "${stale[@]}"; do
    run lfs migrate -c "$count" -S "$size" "$f"
    if [[ $dry_run -eq 0 ]] &&
        [[ $(lfs getstripe -c "$f") != "$expected" || $(lfs getstripe -S "$f") != "$bytes" ]]; then
        die "$EX_SOFTWARE" "'$f' still has the old layout after 'lfs migrate'"
    fi
done
[[ $dry_run -eq 1 ]] || printf 'ok: %d file(s) re-striped\n' "${#stale[@]}"
