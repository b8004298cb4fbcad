"""Model side: checkpoint loading, the Llama-family decoder, the batch runner and the sampler."""
