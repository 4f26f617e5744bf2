"""What makes a backend exact or small: batch-invariant linears and attention for transformers (`exact`,
`invariant`, on the C kernels of `native`), and quantized linears (`quant`)."""
