# syntax=docker/dockerfile:1
#
# The inference engine: vLLM's image with gdsload installed, so that `--load-format gdsload`
# resolves (gdsload's loader registers through the `vllm.general_plugins` entry point, which vLLM
# reads in every worker process). Both Kubernetes modes use this image: next to the sidecar the
# plugin maps the sidecar's tensors through CUDA IPC; without DRA it loads the weights itself.
# Build context is the repository root:
#
#   docker build -f deploy/docker/engine.Dockerfile -t vllm-gdsload:0.1.0 .
#   docker build -f deploy/docker/engine.Dockerfile --build-arg VLLM_IMAGE=vllm/vllm-openai:<tag> .
#
# Pin VLLM_IMAGE to the vLLM release you run. The gdsload extra (cu12 or cu13) follows the CUDA
# of the torch inside that image; vLLM's torch is never replaced (the build checks it). The pods
# run this image as uid 10001 (the sidecar's user, for CUDA IPC), with HOME on a writable volume.

ARG VLLM_IMAGE=vllm/vllm-openai:v0.28.0

# ---- wheel: gdsload is pure Python, so any Python builds it ----------------------------------
FROM python:3.12-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY loader ./loader
COPY server ./server
COPY bench ./bench
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- engine ----------------------------------------------------------------------------------
FROM ${VLLM_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=wheel /wheels /tmp/wheels
# DL3013 (pin pip versions): what is installed is the wheel built above from this checkout;
# its dependencies are bounded by pyproject.toml and vLLM's own pins.
# hadolint ignore=DL3013
RUN torch_before="$(python3 -c 'import torch; print(torch.__version__)')" \
    && major="$(python3 -c 'import torch; print(torch.version.cuda.split(".")[0])')" \
    && wheel="$(echo /tmp/wheels/gdsload-*.whl)" \
    && python3 -m pip install --no-cache-dir "${wheel}[cu${major}]" \
    && rm -rf /tmp/wheels \
    && torch_after="$(python3 -c 'import torch; print(torch.__version__)')" \
    && if [[ "${torch_after}" != "${torch_before}" ]]; then \
         echo "installing gdsload replaced vLLM's torch ${torch_before} with ${torch_after}" >&2; exit 1; \
       fi \
    && python3 -c 'import sys; from importlib.metadata import entry_points; \
sys.exit(0 if any(e.value.startswith("gdsload") for e in entry_points(group="vllm.general_plugins")) \
else "gdsload is installed but not registered in the vllm.general_plugins entry point group")'
