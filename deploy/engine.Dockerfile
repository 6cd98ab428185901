# vLLM's image with the memwatch plugin in it (the engine side of both shapes). From the repository root:
#   docker build -f deploy/engine.Dockerfile -t vllm-memwatch:0.1.0 .
# Only the plugin goes in: memwatch_engine (standard library only) and memwatch_autoload.pth, into the
# site-packages of the image's python3, with the vllm.general_plugins entry point; vLLM's own packages are
# not touched. MEMWATCH=1 in the pod spec turns it on; without it the image behaves as vLLM's own.
# BASE: the vLLM image to extend (the tests build it on a stand-in with the same ENTRYPOINT).
ARG BASE=vllm/vllm-openai:v0.33.0
FROM ${BASE}
COPY pyproject.toml deploy/install_plugin.py /tmp/memwatch/
COPY engine /tmp/memwatch/engine
RUN python3 /tmp/memwatch/install_plugin.py /tmp/memwatch && rm -rf /tmp/memwatch
