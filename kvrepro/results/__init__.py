"""results/: every run kept (store) and the index that lists them fast (index).
"""
