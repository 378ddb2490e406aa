# lmforge in a container: the pinned lock with the CPU build of torch, this checkout at /opt/lmforge.
#   docker build --build-arg LMFORGE_GIT_COMMIT=$(git rev-parse HEAD) -t lmforge:dev .
#   docker run --rm -v $PWD/artifacts:/opt/lmforge/artifacts lmforge:dev            # runs configs/demo.yaml
#   docker run --rm lmforge:dev lmforge run configs/demo.yaml -o store=s3://bucket/prefix   # with AWS_* set
# As the image of a Prefect Docker or Kubernetes work pool, the deployment's pull step is
# set_working_directory /opt/lmforge (README, Deployments). Untested here: the build machine has no docker.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 \
    DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/lmforge

# dependencies first (a layer that changes only with the lock): torch alone from the CPU index, by exact version,
# so no CUDA build is pulled; then the lock with --no-deps, so no resolver re-resolves anything
COPY requirements/lock.txt requirements/lock.txt
RUN python -m pip install "pip==$(sed -n 's/^pip==//p' requirements/lock.txt)" \
 && pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu" \
 && pip install --no-deps -r requirements/lock.txt

COPY . .
RUN pip install --no-deps --no-build-isolation -e .
# no .git in the image: the commit the image was built from goes into every manifest and MLflow run
ARG LMFORGE_GIT_COMMIT=unknown
ENV LMFORGE_GIT_COMMIT=${LMFORGE_GIT_COMMIT}

CMD ["lmforge", "run", "configs/demo.yaml"]
