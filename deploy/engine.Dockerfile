# vLLM's image with the memwatch plugin in it (the engine side of both shapes). From the repository root:
#   docker build -f deploy/engine.Dockerfile -t vllm-memwatch:0.1.0 .
# MEMWATCH=1 in the pod spec turns it on; without it the image behaves as vLLM's own.
FROM vllm/vllm-openai:v0.33.0
COPY pyproject.toml README.md MANIFEST.in build_autoload.py /tmp/memwatch/
COPY engine /tmp/memwatch/engine
COPY memwatch /tmp/memwatch/memwatch
RUN pip install --no-cache-dir /tmp/memwatch && rm -rf /tmp/memwatch
