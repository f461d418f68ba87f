"""
Talk to a long document in the terminal: the document is prefilled once, each turn computes only
its own tokens, and the session (its KV on the tiers, the conversation) is saved after every turn
and resumed bit for bit.

    python chat.py --ckpt DIR --document paper.txt --session ~/chats/paper --offload cpu
    python chat.py --list ./chat_sessions

The command line, the loop and the session live with the operations (runs/chat_cli.py,
runs/chat.py, runs/session.py); running this file runs them.
"""
import sys

if __name__ == "__main__":
    from runs import interrupt
    interrupt.starting("chat.py")  # Ctrl-C while torch imports: one line, exit 130
    from runs.chat_cli import main
    interrupt.started()
    try:
        code = main()
    except KeyboardInterrupt as e:  # while the model loads (in a session, the session's own)
        code = interrupt.ended("chat.py", e, "what the session saved is kept")
    interrupt.finished()  # a stop signal during shutdown: ignored, never a traceback
    sys.exit(code)
