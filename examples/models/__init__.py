"""Example models, each in its own module (import the module you need):

- ``examples.models.ssm``: the adjoint-sharding paper's selective SSM LM (vectorized and loop);
- ``examples.models.llama``: a small Llama-style causal transformer;
- ``examples.models.linear_attention``: a TransNormerLLM-style linear-attention LM;
- ``examples.models.hybrid``: SSM layers interleaved with attention layers.
"""
