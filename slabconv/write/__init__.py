"""Stage 3, write: the fused model as files people deploy, staged and published atomically.

- ``staging``: where outputs go; nothing the user owns is replaced unless slabconv wrote it.
- ``safetensors``: fused weights with provenance metadata; ``shards``: the same, tensor by tensor (streamed).
- ``onnx``: ONNX with a dynamic batch axis; ``pt2``: a ``torch.export`` program.
- ``hf_llama``: a fused LLaMA-PRepBN folder as a Hugging Face folder (remote code, KV cache);
  ``decoder_onnx``: the same model as one ONNX decoder with past key/values.
"""
