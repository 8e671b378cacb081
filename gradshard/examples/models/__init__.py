"""Example models, each in its own module (import the module you need):

- ``gradshard.examples.models.ssm``: the adjoint-sharding paper's selective SSM LM (vectorized and loop);
- ``gradshard.examples.models.llama``: a small Llama-style causal transformer;
- ``gradshard.examples.models.linear_attention``: a TransNormerLLM-style linear-attention LM;
- ``gradshard.examples.models.hybrid``: SSM layers interleaved with attention layers;
- ``gradshard.examples.models.layers``: the norms and MLPs they share.
"""
