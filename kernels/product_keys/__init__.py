"""Product-key top-k and the weighted bag of value rows (ops `product_key_topk`, `weighted_bag`): `reference.py`
(the specification), `triton.py`."""
