"""The invoke door's steps, one module each, in the order `gateway_api.door` runs them.

Each step is a small function or object that can be tested without Temporal (its Temporal
calls, where it has any, go through the object it is given).
"""
