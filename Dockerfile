# lmforge in a container: this checkout at /opt/lmforge, the pinned lock in a venv at /opt/venv, run as the
# non-root user `lmforge`. `make image` builds it with docker or podman (docs/image.md); by hand:
#   docker build --build-context torch-wheels=/path/to/wheels --build-arg LMFORGE_GIT_COMMIT=$(git rev-parse HEAD) \
#       -t lmforge:dev .
#   docker run --rm -v $PWD/artifacts:/opt/lmforge/artifacts lmforge:dev            # runs configs/demo.yaml
#   docker run --rm lmforge:dev lmforge run configs/demo.yaml -o store=s3://bucket/prefix   # with AWS_* set
# Build arguments:
#   BASE_IMAGE      any Debian-based image; one without Python 3.11 gets Debian's python3 + python3-venv
#                   (3.11 in bookworm), e.g. a local localhost/debian:bookworm where no registry can be reached
#   TORCH           cpu (default): torch's CPU build, from the wheel in the `torch-wheels` build context when it
#                   has one (the folder pip's find-links names on a machine that keeps wheels on disk), else from
#                   PyTorch's CPU index TORCH_CPU_INDEX;
#                   cuda: torch from PyPI, whose Linux wheel is the CUDA build, with its nvidia-* libraries
#   TORCH_VERSION   the torch release, the same as requirements/lock.txt
#   PIP_CA_FILE     where the machine reaches PyPI through a TLS proxy: the CA bundle's file name in the `pip-ca`
#                   build context (--build-context pip-ca=/etc/ssl/certs), used by pip at build time only
# As the image of a Prefect Docker or Kubernetes work pool, the deployment's pull step is
# set_working_directory /opt/lmforge (docs/image.md).
ARG BASE_IMAGE=python:3.11-slim

# empty unless the build names a folder for it: --build-context torch-wheels=DIR replaces this stage
FROM scratch AS torch-wheels
# empty unless the build names it: the folder of the CA bundle pip must trust (PIP_CA_FILE)
FROM scratch AS pip-ca

FROM ${BASE_IMAGE}
ARG TORCH=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_CA_FILE=ca-certificates.crt

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 \
    DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

# Python 3.11 in a venv: the base's own when it has one, else Debian's
RUN if ! command -v python3.11 >/dev/null; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3.11 -m venv /opt/venv \
 && useradd --create-home --uid 1000 --shell /bin/bash lmforge \
 && mkdir -p /opt/lmforge && chown lmforge:lmforge /opt/lmforge
WORKDIR /opt/lmforge

# dependencies first (a layer that changes only with the lock): torch alone, by exact version, then the rest of the
# lock with --no-deps, so no resolver re-resolves anything and no other torch build comes in
COPY requirements/lock.txt requirements/lock.txt
RUN --mount=type=bind,from=torch-wheels,target=/wheels --mount=type=bind,from=pip-ca,target=/pip-ca \
    set -e; \
    if [ -f "/pip-ca/$PIP_CA_FILE" ]; then export PIP_CERT="/pip-ca/$PIP_CA_FILE"; fi; \
    pip install "pip==$(sed -n 's/^pip==//p' requirements/lock.txt)"; \
    case "$TORCH" in \
      cpu) wheel=$(ls /wheels/torch-${TORCH_VERSION}+cpu-cp311-*.whl 2>/dev/null | head -n 1); \
           if [ -n "$wheel" ]; then echo "torch: $wheel"; pip install --no-deps "$wheel"; \
           else echo "torch: ${TORCH_CPU_INDEX}"; \
                pip install --no-deps --index-url "$TORCH_CPU_INDEX" "torch==${TORCH_VERSION}+cpu"; fi ;; \
      cuda) echo "torch: PyPI (CUDA build)"; pip install "torch==${TORCH_VERSION}" ;; \
      *) echo "TORCH=$TORCH: expected cpu or cuda" >&2; exit 2 ;; \
    esac; \
    grep -v '^torch==' requirements/lock.txt > /tmp/lock-without-torch.txt; \
    pip install --no-deps -r /tmp/lock-without-torch.txt; \
    rm /tmp/lock-without-torch.txt

COPY --chown=lmforge:lmforge . .
RUN pip install --no-deps --no-build-isolation -e .
# no .git in the image: the commit the image was built from goes into every manifest and MLflow run
ARG LMFORGE_GIT_COMMIT=unknown
ENV LMFORGE_GIT_COMMIT=${LMFORGE_GIT_COMMIT} HF_HOME=/home/lmforge/.cache/huggingface
USER lmforge

CMD ["lmforge", "run", "configs/demo.yaml"]
