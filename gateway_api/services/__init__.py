"""The gateway's services beside the door: agents (join, heartbeat, leave), request reads
(status, delivery, late answers) and the admin views (readiness, policy, routing)."""
