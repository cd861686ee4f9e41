# The mtq image: supervised workers (torch; the PyPI wheel bundles CUDA, so the same
# image serves GPUs and CPUs), the MiniLM embedding example with its weights, and the
# dashboard. docker-compose.yml builds and runs it; by hand:
#
#   docker build -t mtq .
#   docker run --rm --gpus all -e MTQ_REDIS_URL=redis://HOST:6379/0 mtq \
#       mtq workers start mtq.reference.gpt:TinyGPT --queue chat --devices all
#
# There is no ENTRYPOINT: a container's command is the whole command line, starting
# with "mtq" (or "python", "bash", ...).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app \
    MTQ_HOME=/var/lib/mtq

WORKDIR /app

# 1. The dependencies, from pyproject.toml alone (an empty package stands in for mtq),
#    so that a change to the source does not download torch again. They come through
#    the package's extras, so pyproject's version constraints hold: never install torch
#    or another dependency by name here.
COPY pyproject.toml README.md ./
RUN mkdir mtq && touch mtq/__init__.py \
 && pip install --no-cache-dir ".[workers,examples,metrics]" \
 && rm -rf mtq build ./*.egg-info

# 2. The source: the mtq package (installed, for the mtq command) and the examples,
#    which the distribution does not include: PYTHONPATH=/app makes examples.* targets
#    importable, e.g. examples.embeddings:MiniLM.
COPY mtq ./mtq
COPY examples ./examples
RUN pip install --no-cache-dir --no-deps --force-reinstall . \
 && rm -rf build ./*.egg-info

# 3. A user of its own; MTQ_HOME (the reference generator's weights cache) belongs to it,
#    so a fresh named volume mounted there is writable too.
RUN useradd --create-home --uid 10001 --user-group mtq \
 && mkdir -p /var/lib/mtq \
 && chown mtq:mtq /var/lib/mtq
USER mtq

CMD ["mtq", "--help"]
