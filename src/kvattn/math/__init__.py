"""The math every layer above builds on, with no state and no kernel choice: attention (`ops`, and the one
axis legend), rotary positions (`rope`), norms (`norms`) and the weight forms with their quantizer (`quant`)."""
