# melissa_dl with its MPI (mpich wheel), the CPU build of torch, and the C and
# Fortran client library (built with Debian's MPICH, from scripts/system-packages).
FROM python:3.11-slim
WORKDIR /opt/melissa_dl
COPY pyproject.toml README.md ./
COPY scripts scripts
COPY native native
COPY melissa_dl melissa_dl
COPY launcher launcher
COPY melissa_api melissa_api
COPY examples examples
RUN scripts/system-packages install native \
 && make -C native install BUILD=/tmp/native PREFIX=/usr/local MPICC=mpicc.mpich MPIFC=mpifort.mpich \
 && ldconfig && rm -rf /tmp/native /var/lib/apt/lists/*
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir mpich . \
 && useradd --create-home melissa
USER melissa
CMD ["melissa-server", "--help"]
