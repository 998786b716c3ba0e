# melissa_dl with its MPI (mpich wheel) and the CPU build of torch.
FROM python:3.11-slim
WORKDIR /opt/melissa_dl
COPY pyproject.toml README.md ./
COPY melissa_dl melissa_dl
COPY launcher launcher
COPY examples examples
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir mpich . \
 && useradd --create-home melissa
USER melissa
CMD ["melissa-server", "--help"]
