"""The one door's guards (R18-R20, R26): tokens, authorization rules, audit with redaction,
the address guard against request forgery, callback signatures, payload encryption, certificates.

Pure logic and small stores; the gateway, the activities and the connectors apply them.
"""
