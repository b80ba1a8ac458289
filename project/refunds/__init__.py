"""The refund agent example: a support team's orders, refunds and customer emails, handled by a durable agent."""
