"""The attention layer: the pure step (`forward`), the NNX module (`attention`), the fast drivers
(`decoding`) and sharding over a mesh (`sharding`)."""
