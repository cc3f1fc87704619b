# kvrepro for CI: CPU only, GPU-free, no registry. Filled in by kvrepro/deploy/docker/ciimage.py
# ({deps_image}, {kvrepro_wheel}, {version}). The base is kvrepro's own CPU dependencies layer:
# Debian from debootstrap, torch (CPU) and vLLM {version}'s requirements. Every input comes in the
# build context (the build runs with no network): GNU patch (.deb), the kvrepro wheel and the
# wheels of its dependencies, and the vLLM wheel, placed where kvrepro caches it.
FROM {deps_image}
COPY debs/ /tmp/kvrepro-ci/debs/
COPY wheels/ /tmp/kvrepro-ci/wheels/
COPY vllm/ /opt/kvrepro-home/wheels/{version}/
RUN dpkg -i /tmp/kvrepro-ci/debs/*.deb \
 && python3 -m pip install --break-system-packages --no-index --find-links=/tmp/kvrepro-ci/wheels --no-cache-dir \
      --root-user-action=ignore --disable-pip-version-check --progress-bar=off /tmp/kvrepro-ci/wheels/{kvrepro_wheel} \
 && rm -rf /tmp/kvrepro-ci
# the runtime env is made over the system's torch and vLLM dependencies (no download, no copy)
ENV KVREPRO_HOME=/opt/kvrepro-home KVREPRO_RUNTIME_SYSTEM_SITE=1 PYTHONUNBUFFERED=1 LANG=C.UTF-8
# the default matrix's runtime env and build overlays, made once here instead of in every CI job
RUN mkdir /tmp/kvrepro-starter && cd /tmp/kvrepro-starter && kvrepro init && kvrepro setup \
 && cd / && rm -rf /tmp/kvrepro-starter
WORKDIR /work
ENTRYPOINT ["kvrepro"]
CMD ["--help"]
