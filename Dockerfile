# syntax=docker/dockerfile:1
# hvd_train in a container: the repository plus what mpi_scripts/install.sh installs, nothing more;
# every set-up step lives in the installer, which bare machines and CI run too.
#   CPU:  docker build -t hvd_train .
#   GPU:  docker build -t hvd_train:gpu --build-arg GPU=1 \
#           --build-arg BASE=nvidia/cuda:12.5.1-devel-ubuntu22.04 .
#   classic stack (TensorFlow 2.15 + Keras 2, Horovod's own Keras optimizer):
#         docker build -t hvd_train:classic --build-arg STACK=classic .
#   run:  docker run --rm hvd_train                                  # hvd-train doctor
#         docker run --rm --gpus all --shm-size=1g hvd_train:gpu train --config configs/digits.yaml
# Without a registry, mpi_scripts/container.sh makes the base from Debian's packages and builds this
# file with podman/buildah (docs/containers.md). The GPU base is then that Debian base plus the CUDA
# toolkit from NVIDIA's Python wheels; elsewhere a -devel image, because Horovod's NCCL ops compile
# against the CUDA headers. Such a base has no Python of its own: the installer's apt step brings
# the distribution's python3 (Debian 12: 3.11; Ubuntu 22.04: 3.10; the stack supports 3.10+). GPU is
# a build argument, not detected, because no GPU is visible while an image builds. Give containers
# --shm-size: Open MPI passes messages between the ranks of one host through /dev/shm, which is 64 MB
# by default.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ARG GPU=0
ARG STACK=modern
# Behind a proxy that re-signs TLS, pip needs that proxy's CA: container.sh binds the host's bundle
# for the build only (at /mnt, so no mount point is left in a layer) and names it here.
ARG PIP_CERT
# Also read by mpi_scripts/run.sh and the Makefile, so they use this environment in the container.
# The image holds one stack, so one venv path serves both: the installer takes VENV as given.
ENV VENV=/opt/hvd_train/venv
WORKDIR /opt/hvd_train/src
# What the installer reads comes first, so that a change to the tests, docs or configs reuses the
# installed layer.
COPY requirements/ requirements/
COPY mpi_scripts/install.sh mpi_scripts/horovod_build.sh mpi_scripts/
COPY mpi_scripts/patches/ mpi_scripts/patches/
COPY setup.py pyproject.toml ./
COPY hvd_train/ hvd_train/
COPY models/ models/
# Build caches stay out of the image and serve the next build: pip's downloads and the Horovod wheel
# the installer builds (under /root/.cache, keyed by what it was built against), and apt's lists and
# packages. The image runs as the unprivileged user hvd (uid 1000); the installed tree stays root's.
RUN --mount=type=cache,target=/root/.cache \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    --mount=type=cache,target=/var/cache/apt,sharing=locked \
    GPU="$GPU" STACK="$STACK" bash mpi_scripts/install.sh \
    && useradd --uid 1000 --user-group --create-home --shell /bin/bash hvd
# The GPU variant must also pass the compile check of Horovod's NCCL path (no GPU needed), with the
# toolkit the installer built with; its build folder does not outlive the step.
COPY mpi_scripts/check_nccl_build.sh mpi_scripts/
RUN --mount=type=cache,target=/root/.cache \
    if [ "$GPU" = 1 ]; then \
      NCCL_CHECK_DIR=/tmp/nccl-check bash mpi_scripts/check_nccl_build.sh && rm -rf /tmp/nccl-check; \
    fi
COPY . .
# Matplotlib's cache under /tmp: the user's home is not writable in a --read-only container.
ENV PATH=$VENV/bin:$PATH MPLCONFIGDIR=/tmp/matplotlib
USER 1000:1000
ENTRYPOINT ["hvd-train"]
CMD ["doctor"]
