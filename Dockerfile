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
# The GPU base is a -devel image because Horovod's NCCL ops compile against the CUDA headers. It has
# no Python of its own: the installer's apt step brings Ubuntu 22.04's python3, 3.10 (the CPU image
# has 3.11; the stack supports 3.10+). GPU is a build argument, not detected, because no GPU is
# visible while an image builds. Give containers --shm-size: Open MPI passes messages between the
# ranks of one host through /dev/shm, which is 64 MB by default.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ARG GPU=0
ARG STACK=modern
# Also read by mpi_scripts/run.sh and the Makefile, so they use this environment in the container.
# The image holds one stack, so one venv path serves both: the installer takes VENV as given.
ENV VENV=/opt/hvd_train/venv
WORKDIR /opt/hvd_train/src
COPY . .
# Build caches stay out of the image and serve the next build: pip's downloads and the Horovod wheel
# the installer builds (under /root/.cache, keyed by what it was built against), and apt's lists.
RUN --mount=type=cache,target=/root/.cache \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    GPU="$GPU" STACK="$STACK" bash mpi_scripts/install.sh
ENV PATH=$VENV/bin:$PATH
ENTRYPOINT ["hvd-train"]
CMD ["doctor"]
