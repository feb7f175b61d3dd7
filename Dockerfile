# The kembed platform image: the API (`kembed serve`) and the operator (`kembed-operator`), one image, two commands.
#   docker build -t kembed/platform:0.1.0 .
# The trainer has its own image (trainer_image/Dockerfile): the platform never needs torch, the trainer never
# needs FastAPI or Kopf. The Helm chart (helm/kembed) runs this image as UID 10001 with a read-only root.
# The base is a build argument so a build without access to Docker Hub can use a local Python 3.11 bookworm image
# (`make images` does: see docs/testing.md); everyone else keeps the official one.
ARG BASE=python:3.11-slim-bookworm
ARG DEPS=deps

FROM ${BASE} AS deps
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/kembed
COPY pyproject.toml constraints.txt ./
# Two stages, as in the trainer's image: `deps` installs the pinned requirements of the project and of its api and
# operator extras, read from pyproject.toml; the final stage only kembed's own packages, so a code change rebuilds
# seconds of work. DEPS may name a `deps` stage built before (an image reference), as `make images` does.
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['api'] + p['optional-dependencies']['operator']))" \
    > /tmp/platform-requirements.txt \
    && pip install --no-cache-dir -c constraints.txt -r /tmp/platform-requirements.txt \
    && rm /tmp/platform-requirements.txt

FROM ${DEPS}
WORKDIR /opt/kembed
COPY pyproject.toml constraints.txt README.md ./
COPY contract ./contract
COPY api ./api
COPY operator ./operator
# The one module of the API that runs trainer code (kembed_api.jobs.exports) needs the trainer package; without
# its extra (torch) it answers that exports run where the trainer's dependencies are.
COPY trainer_image/kembed_trainer ./trainer_image/kembed_trainer
# --no-deps: the deps stage installed them from the same pyproject.toml and pins.
RUN pip install --no-cache-dir --no-deps -c constraints.txt ".[api,operator]" \
    && python -c "import kembed_api.app, kembed_operator.__main__" \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent kembed

USER 10001:10001
EXPOSE 8080
# The chart always names the command; this default is the API.
CMD ["kembed", "serve", "--host", "0.0.0.0", "--port", "8080", "--data-dir", "/tmp/kembed"]
