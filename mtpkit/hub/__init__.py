"""Publishing a pair on the Hugging Face Hub: the target and its assistant as two repos vLLM loads by id.

`plan_push` decides everything on files (and refuses what must not be published); `push` sends it.
May import mtpkit.convert, mtpkit.formats and mtpkit.errors; never the CLI, the runtime or calibration.
"""

from mtpkit.hub.errors import HubAuthError, HubError, PushRefusedError
from mtpkit.hub.plan import PushPlan, RepoPlan, UploadFile, plan_push, token_source
from mtpkit.hub.upload import RepoResult, RetryPolicy, push

__all__ = ["HubAuthError", "HubError", "PushPlan", "PushRefusedError", "RepoPlan", "RepoResult", "RetryPolicy",
           "UploadFile", "plan_push", "push", "token_source"]
