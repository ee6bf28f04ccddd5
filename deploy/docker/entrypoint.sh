#!/bin/bash
# Entry point of the gdsload sidecar image; the systemd unit runs it too, so containers and
# bare-metal hosts start the sidecar the same way.
#
#   gdsload-entrypoint                          same as: gdsload-entrypoint serve
#   gdsload-entrypoint serve [MODEL_DIR] [OPTIONS...]
#   gdsload-entrypoint doctor|inspect|load|...  passed to gdsload unchanged
#
# For `serve` it fills in what the orchestrator knows but the command line does not say:
#   GDSLOAD_MODEL_DIR      MODEL_DIR, when the command line gives none.
#   GDSLOAD_NODE_INDEX     multi-node (LeaderWorkerSet, one pod per node): node i loads the
#   GDSLOAD_GPUS_PER_NODE  ranks i*G .. i*G+G-1, passed as `--ranks A-B`. Used only when neither
#                          --tp/--ranks nor GDSLOAD_TP/GDSLOAD_RANKS is given; set both or neither.
# and refuses to start (exit 78, EX_CONFIG) when
#   - a token file is configured (--token-file, GDSLOAD_TOKEN_FILE) but is unreadable or empty:
#     better a clear message now than a sidecar whose IPC hand-off rejects every engine later;
#   - the server would listen beyond loopback (--host, GDSLOAD_HOST) without any token: the
#     server would then refuse every IPC hand-off, reload and unload (403) while anyone who reaches
#     the port reads its status; a sidecar listening on the pod network is always meant to hand
#     off, so a missing token is a deployment error, better caught at start than at the engine.
# Usage errors exit 64 (EX_USAGE). Otherwise it execs gdsload, which then owns PID and signals.
#
# Options of `serve` are passed on exactly as given. The entry point knows which of them take a
# value (the list in the loop below; a test keeps it in step with `gdsload serve`); an option it
# does not know must be written --option=value, so that its value is not taken for MODEL_DIR.
set -euo pipefail

readonly EX_USAGE=64 EX_CONFIG=78

die() {
    local code=$1
    shift
    printf 'gdsload-entrypoint: %s\n' "$*" >&2
    exit "$code"
}

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

is_loopback() {
    case $1 in
        127.* | ::1 | localhost | '[::1]') return 0 ;;
        *) return 1 ;;
    esac
}

if [[ $# -eq 0 ]]; then
    set -- serve
fi
if [[ $1 != serve ]]; then
    exec gdsload "$@"
fi
shift

# Scan (never rewrite) the serve options: what is given, and what the server will bind to.
host=${GDSLOAD_HOST:-127.0.0.1}
token_file=${GDSLOAD_TOKEN_FILE:-}
has_model_dir=0
has_ranks=0
if [[ -n ${GDSLOAD_TP:-} || -n ${GDSLOAD_RANKS:-} ]]; then
    has_ranks=1
fi
args=("$@")
i=0
while [[ $i -lt ${#args[@]} ]]; do
    arg=${args[i]}
    case $arg in
        --tp | --tensor-parallel-size | --ranks | --device-map | --backend | --host | --port | --token-file | --allow-root | --allowed-host | \
            --log-format | --log-level | --restart-backoff | --restart-backoff-max | --max-restarts | \
            --stop-timeout | --request-timeout | --lease-grace | --worker-start)
            [[ $((i + 1)) -lt ${#args[@]} ]] || die "$EX_USAGE" "option $arg needs a value"
            value=${args[i + 1]}
            case $arg in
                --tp | --tensor-parallel-size | --ranks) has_ranks=1 ;;
                --host) host=$value ;;
                --token-file) token_file=$value ;;
            esac
            i=$((i + 2))
            continue
            ;;
        --tp=* | --tensor-parallel-size=* | --ranks=*) has_ranks=1 ;;
        --host=*) host=${arg#*=} ;;
        --token-file=*) token_file=${arg#*=} ;;
        --)
            if [[ $((i + 1)) -lt ${#args[@]} ]]; then
                has_model_dir=1
            fi
            break
            ;;
        -*) ;; # a flag of gdsload's own (e.g. --help): passed on as is
        *) has_model_dir=1 ;;
    esac
    i=$((i + 1))
done

prefix=()
if [[ $has_model_dir -eq 0 ]]; then
    [[ -n ${GDSLOAD_MODEL_DIR:-} ]] ||
        die "$EX_USAGE" "gdsload serve needs MODEL_DIR: give it as an argument or set GDSLOAD_MODEL_DIR"
    prefix=("$GDSLOAD_MODEL_DIR")
fi

suffix=()
node_index=${GDSLOAD_NODE_INDEX:-}
gpus_per_node=${GDSLOAD_GPUS_PER_NODE:-}
if [[ -n $node_index || -n $gpus_per_node ]]; then
    if [[ $has_ranks -eq 1 ]]; then
        printf 'gdsload-entrypoint: --tp/--ranks given; GDSLOAD_NODE_INDEX/GDSLOAD_GPUS_PER_NODE ignored\n' >&2
    else
        [[ -n $node_index && -n $gpus_per_node ]] ||
            die "$EX_USAGE" "set both GDSLOAD_NODE_INDEX and GDSLOAD_GPUS_PER_NODE, or neither" \
                "(got GDSLOAD_NODE_INDEX='$node_index', GDSLOAD_GPUS_PER_NODE='$gpus_per_node')"
        is_uint "$node_index" ||
            die "$EX_USAGE" "GDSLOAD_NODE_INDEX='$node_index' is not a non-negative integer"
        if ! is_uint "$gpus_per_node" || [[ $((10#$gpus_per_node)) -lt 1 ]]; then
            die "$EX_USAGE" "GDSLOAD_GPUS_PER_NODE='$gpus_per_node' is not a positive integer"
        fi
        first=$((10#$node_index * 10#$gpus_per_node))
        suffix=(--ranks "$first-$((first + 10#$gpus_per_node - 1))")
    fi
fi

if [[ -n $token_file ]]; then
    [[ -f $token_file && -r $token_file ]] ||
        die "$EX_CONFIG" "token file '$token_file' is missing or not readable by uid $(id -u)" \
            "(Kubernetes: is the Secret mounted there? systemd: is LoadCredential= set?)"
    [[ -s $token_file ]] || die "$EX_CONFIG" "token file '$token_file' is empty"
elif [[ -z ${GDSLOAD_TOKEN:-} ]] && ! is_loopback "$host"; then
    die "$EX_CONFIG" "refusing to listen on '$host' without a token: the engine's /v1/ipc hand-off" \
        "(and reload/unload) would be refused; set GDSLOAD_TOKEN_FILE (or GDSLOAD_TOKEN), or bind to 127.0.0.1"
fi

exec gdsload serve "${prefix[@]}" "$@" "${suffix[@]}"
