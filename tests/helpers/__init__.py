"""Code the tests share: the oracle comparison (reference), the pages' snippets, the
transcribed dilated-attention-pytorch reference, the spawned gloo processes' workers and the
checks more than one test module runs. Nothing here is collected as a test."""
