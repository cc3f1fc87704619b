# kvrepro CPU base, last layer: kvrepro's vLLM plugin (GPU-free platform + executor) and the `vllm`
# shim on top of an image that holds torch (CPU), vLLM's dependencies and vLLM itself, installed
# as in vllm/vllm-openai. Filled in by kvrepro/deploy/docker/basecpu.py: {vllm_image} and {purelib}.
FROM {vllm_image}
RUN ["/bin/sh", "-c", "[ -e /usr/local/bin/vllm-upstream ] || mv /usr/local/bin/vllm /usr/local/bin/vllm-upstream"]
COPY opt/kvrepro/ /opt/kvrepro/
COPY plugin/ {purelib}/
COPY vllm-shim.sh /usr/local/bin/vllm
COPY kvrepro-engine.pth {purelib}/kvrepro-engine.pth
ENV PYTHONUNBUFFERED=1 VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 VLLM_NO_USAGE_STATS=1
ENTRYPOINT ["vllm", "serve"]
CMD []
