# The image of examples/kuberay-rayservice.yaml: Ray's own image (the Ray version of the manifest's rayVersion) with
# Lumen, its CPU / Qwen / Gemma / CUDA plugins and Ray Serve. Build it from the root of a Lumen clone and push it
# where your cluster pulls from (docs/scale-out.md):
#   docker build -f examples/kuberay.Dockerfile -t lumen-serve:0.1.0 .
FROM rayproject/ray:2.60.0-py311-cu128
COPY --chown=ray:users . /home/ray/lumen
WORKDIR /home/ray/lumen
RUN pip install --no-cache-dir -e ".[scale-out]" -e plugins/lumen-cpu -e plugins/models-qwen \
        -e plugins/models-gemma -e "plugins/lumen-cuda[cuda12]"
