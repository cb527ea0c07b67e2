"""`POST /v1/messages` (Anthropic's Messages API)."""


def install_messages(app, service) -> None:
    pass
