# shellcheck shell=bash
# Shared by proxy.sh, prefill.sh and decode.sh; sourced, never run.
#
# Life cycle of a launch: read the env file (KEY=value lines, the format
# systemd's EnvironmentFile= reads too), check the variables the role needs,
# create the log and cache directories, then exec `tessera ROLE --config
# $TESSERA_CONFIG_DIR/ROLE.yaml --set ...` so that tessera replaces the shell
# (same PID: systemd's Type=notify and signals reach it directly). Every
# variable is documented in tessera.env.example.

tessera_die() {
    echo "tessera launch: $*" >&2
    exit 2
}

# Loads the env file named by $1, else $TESSERA_ENV_FILE, else /etc/tessera/tessera.env.
tessera_load_env() {
    TESSERA_ENV_FILE=${1:-${TESSERA_ENV_FILE:-/etc/tessera/tessera.env}}
    [[ -r $TESSERA_ENV_FILE ]] || tessera_die "env file $TESSERA_ENV_FILE is missing or unreadable" \
        "(pass its path as the first argument; every variable is described in deploy/launch/tessera.env.example)"
    # Everything the file sets is exported: UCX_*, CUDA_VISIBLE_DEVICES and TESSERA_CACHE_DIR are
    # read by the libraries and by tessera's config loader in the child, not by this script.
    set -a
    # shellcheck source=/dev/null
    . "$TESSERA_ENV_FILE"
    set +a
}

tessera_require() {
    local name
    for name in "$@"; do
        [[ -n ${!name:-} ]] || tessera_die "required variable $name is not set in $TESSERA_ENV_FILE" \
            "(see deploy/launch/tessera.env.example)"
    done
}

# Creates a directory the role writes to, or stops with the reason.
tessera_make_dir() {
    local variable=$1 dir=$2
    mkdir -p -- "$dir" || tessera_die "cannot create $variable=$dir"
    [[ -w $dir ]] || tessera_die "$variable=$dir is not writable by $(id -un)"
}

# Appends the role-specific extra overrides ($1 names the variable) to the array named by $2.
tessera_extra_sets() {
    local variable=$1 item
    local -n into=$2
    local -a items=()
    read -r -a items <<<"${!variable:-}"
    for item in "${items[@]}"; do
        [[ $item == *=* ]] || tessera_die "$variable holds '$item': each entry must be key=value"
        into+=(--set "$item")
    done
}

# Sets up logging and the cache, then replaces this shell with `tessera ROLE`.
# $1: role, $2: name of the log file (no extension), the rest: tessera's arguments after the role.
tessera_exec() {
    local role=$1 name=$2
    shift 2
    local config_dir=${TESSERA_CONFIG_DIR:-/etc/tessera}
    local config=$config_dir/$role.yaml
    [[ -r $config ]] || tessera_die "config $config is missing or unreadable (TESSERA_CONFIG_DIR=$config_dir)"
    local bin=${TESSERA_BIN:-tessera}
    command -v -- "$bin" >/dev/null || tessera_die "TESSERA_BIN=$bin is not an executable command"
    if [[ -n ${TESSERA_CACHE_DIR:-} ]]; then
        tessera_make_dir TESSERA_CACHE_DIR "$TESSERA_CACHE_DIR"
    fi
    if [[ -n ${TESSERA_LOG_DIR:-} ]]; then
        tessera_make_dir TESSERA_LOG_DIR "$TESSERA_LOG_DIR"
        echo "tessera launch: $role $name logs to $TESSERA_LOG_DIR/$name.log" >&2
        exec >>"$TESSERA_LOG_DIR/$name.log" 2>&1
    fi
    local log_format=${TESSERA_LOG_FORMAT:-text}
    [[ $log_format == text || $log_format == json ]] ||
        tessera_die "TESSERA_LOG_FORMAT=$log_format must be text or json"
    exec "$bin" "$role" --config "$config" --log-level "${TESSERA_LOG_LEVEL:-INFO}" --log-format "$log_format" "$@"
}

# Overrides shared by the proxy and the workers: the model and dtype must agree across the cluster.
tessera_model_sets() {
    local -n sets_out=$1
    local prefix=$2
    sets_out+=(--set "${prefix}model=$TESSERA_MODEL" --set "${prefix}dtype=$TESSERA_DTYPE")
}

# Every proxy process a worker registers with: each host of TESSERA_PROXY_HOST (comma-separated), each of its
# TESSERA_PROXY_PROCESSES processes (worker ports TESSERA_WORKER_PORT + i).
tessera_proxy_addresses() {
    local processes=${TESSERA_PROXY_PROCESSES:-1} port=${TESSERA_WORKER_PORT:-5555} host i
    [[ $processes =~ ^[1-9][0-9]*$ ]] ||
        tessera_die "TESSERA_PROXY_PROCESSES=$processes must be a number >= 1"
    local -a addresses=()
    for host in ${TESSERA_PROXY_HOST//,/ }; do
        for ((i = 0; i < processes; i++)); do addresses+=("tcp://$host:$((port + i))"); done
    done
    local IFS=,
    echo "${addresses[*]}"
}

tessera_launch_proxy() {
    tessera_load_env "${1:-}"
    tessera_require TESSERA_MODEL TESSERA_DTYPE
    local -a sets=(
        --set "host=${TESSERA_HTTP_HOST:-0.0.0.0}"
        --set "port=${TESSERA_HTTP_PORT:-8000}"
        --set "worker_bind=tcp://${TESSERA_WORKER_BIND_HOST:-0.0.0.0}:${TESSERA_WORKER_PORT:-5555}"
    )
    if [[ -n ${TESSERA_REDIS_URL:-} ]]; then sets+=(--set "shared_state.redis_url=$TESSERA_REDIS_URL"); fi
    tessera_model_sets sets ""
    tessera_extra_sets TESSERA_PROXY_SET sets
    local processes=${TESSERA_PROXY_PROCESSES:-1}
    [[ $processes =~ ^[1-9][0-9]*$ ]] ||
        tessera_die "TESSERA_PROXY_PROCESSES=$processes must be a number >= 1"
    if ((processes > 1)); then sets+=(--processes "$processes"); fi
    tessera_exec proxy proxy "${sets[@]}"
}

# $1: prefill or decode, $2: the env file (optional).
tessera_launch_worker() {
    local role=$1
    tessera_load_env "${2:-}"
    tessera_require TESSERA_MODEL TESSERA_DTYPE TESSERA_PROXY_HOST TESSERA_HOST_ADDRESS
    local instance=${TESSERA_INSTANCE:-0}
    [[ $instance =~ ^[0-9]+$ ]] ||
        tessera_die "TESSERA_INSTANCE=$instance must be a number (the worker's index on this host)"
    local worker_id=${TESSERA_WORKER_ID:-$(hostname)-$role-$instance}
    local -a sets=(
        --set "worker_id=$worker_id"
        --set "proxy_address=$(tessera_proxy_addresses)"
        --set "transfer_host=$TESSERA_HOST_ADDRESS"
    )
    tessera_model_sets sets "engine."
    # Tensor parallelism and devices, per role: instance i of a role at TP n takes the n GPUs from
    # TESSERA_<ROLE>_FIRST_GPU + i * n, one per rank (engine.device=cuda:K; its ranks take K..K+n-1).
    local tp_variable=TESSERA_${role^^}_TP gpu_variable=TESSERA_${role^^}_FIRST_GPU
    local tp=${!tp_variable:-1}
    [[ $tp =~ ^[1-9][0-9]*$ ]] || tessera_die "$tp_variable=$tp must be a number >= 1"
    if ((tp > 1)); then sets+=(--set "engine.tensor_parallel_size=$tp"); fi
    if [[ -n ${!gpu_variable:-} ]]; then
        [[ ${!gpu_variable} =~ ^[0-9]+$ ]] || tessera_die "$gpu_variable=${!gpu_variable} must be a GPU index"
        [[ ${TESSERA_DEVICE:-cuda} == cuda ]] ||
            tessera_die "$gpu_variable is set but TESSERA_DEVICE=$TESSERA_DEVICE (GPUs need TESSERA_DEVICE=cuda)"
        sets+=(--set "engine.device=cuda:$((${!gpu_variable} + instance * tp))")
    elif [[ -n ${TESSERA_DEVICE:-} ]]; then
        sets+=(--set "engine.device=$TESSERA_DEVICE")
    fi
    if [[ -n ${TESSERA_THREADS:-} ]]; then sets+=(--set "engine.num_threads=$TESSERA_THREADS"); fi
    if [[ -n ${TESSERA_TRANSFER_BACKEND:-} ]]; then sets+=(--set "transfer_backend=$TESSERA_TRANSFER_BACKEND"); fi
    if [[ -n ${TESSERA_METRICS_PORT:-} ]]; then
        [[ $TESSERA_METRICS_PORT =~ ^[0-9]+$ ]] ||
            tessera_die "TESSERA_METRICS_PORT=$TESSERA_METRICS_PORT must be a port number"
        # One port per instance, so that several workers of a host can all be scraped.
        sets+=(--set "observability.metrics_host=${TESSERA_METRICS_HOST:-$TESSERA_HOST_ADDRESS}"
               --set "observability.metrics_port=$((TESSERA_METRICS_PORT + instance))")
    fi
    tessera_extra_sets "TESSERA_${role^^}_SET" sets
    tessera_exec "$role" "$worker_id" "${sets[@]}"
}
