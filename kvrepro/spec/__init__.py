"""The experiment as written: matrix.yaml parsed and shape-checked (matrix), the KV geometry it asks for.
"""
