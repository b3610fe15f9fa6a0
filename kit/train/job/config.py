"""Job config: what a ModelArts training job needs beyond the training run itself (where on OBS, which image or
preset engine, which flavor and pool, how many nodes). The run's own settings stay in `TrainConfig`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Optional

# ModelArts' job name rule (huaweicloudsdkmodelarts JobMetadata.name: 1-64 digits, letters, '_' and '-')
_JOB_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# dedicated-pool virtual flavors and their cards per node (ModelArts manual, section "步骤5：使用SDK提交训练作业",
# table "专属资源池虚拟规格的说明"; SDK SpecResource.flavor_id adds 16xlarge)
POOL_FLAVOR_CARDS = {
    "modelarts.pool.visual.xlarge": 1,
    "modelarts.pool.visual.2xlarge": 2,
    "modelarts.pool.visual.4xlarge": 4,
    "modelarts.pool.visual.8xlarge": 8,
    "modelarts.pool.visual.16xlarge": 16,
}
LAUNCHERS = ("torchrun", "deepspeed")
# an OBS folder: obs://<bucket>/... with OBS's bucket rule (3-63 lower-case letters, digits, '.', '-'; a letter or
# digit at each end); a flavor: ModelArts' dotted lower-case ids (public ones differ by region, so any such id goes);
# an SWR image: [registry/]organization/name[:tag], no spaces
_OBS_DIR = re.compile(r"^obs://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$")
_FLAVOR = re.compile(r"^modelarts(\.[a-z0-9_-]+)+$")
_IMAGE = re.compile(
    r"^([A-Za-z0-9.-]+(:[0-9]+)?/)?[a-z0-9][a-z0-9._-]*/[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9._-]{1,128})?$"
)


@dataclass
class JobConfig:
    """One ModelArts training job that runs a TrainConfig on NODES nodes, inputs and outputs on OBS."""

    obs_dir: str = ""
    """OBS folder of the job, obs://bucket/folder/: inputs go under data/ and model/, outputs under output/, logs under logs/."""
    nodes: int = 1
    """Nodes of the job (spec.resource.node_count); each runs one kit launcher, NNODES on the node."""
    flavor: str = "modelarts.pool.visual.8xlarge"
    """Resource flavor per node, e.g. modelarts.pool.visual.8xlarge (8 cards, dedicated pool)."""
    pool_id: str = ""
    """Dedicated resource pool ID (ModelArts console); needed with the modelarts.pool.visual.* flavors."""
    image_url: str = ""
    """SWR image holding torch(+torch_npu) and the kit, org/name:tag or swr.<region>.myhuaweicloud.com/org/name:tag."""
    engine_name: str = ""
    """Preset engine instead of an image (e.g. PyTorch); needs ENGINE_VERSION and CODE_DIR."""
    engine_version: str = ""
    """Version of the preset engine, as the ModelArts console lists it."""
    code_dir: str = ""
    """OBS folder holding a copy of this kit checkout; empty: the image has the kit installed."""
    data_obs: str = ""
    """OBS copy of notebook 02's prepared-data folder (with its kit_manifest.json); empty: <OBS_DIR>/data/<folder>/."""
    model_obs: str = ""
    """OBS copy of the HF model folder; empty: <OBS_DIR>/model/<folder>/."""
    python: str = "python"
    """Python interpreter on the nodes (e.g. /home/ma-user/anaconda3/envs/PyTorch-2.1.0/bin/python)."""
    launcher: str = "torchrun"
    """Launcher each node runs: torchrun | deepspeed."""
    name: str = ""
    """Job name (1-64 letters, digits, '_', '-'); empty: kit-<MODEL_NAME>-<RUN_TYPE>-<UTC time>."""
    description: str = ""
    """Job description; empty: the run type and the manifest hashes of the inputs."""
    workspace_id: str = ""
    """ModelArts workspace ID; empty: the default workspace."""
    environments: Dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the job's containers (never credentials: jobs get them from their agency)."""
    card: str = "910B-64G"
    """The flavor's card, for the fit check before anything is sent (kit plan): 910B-64G, 910B4-32G, A100-80G, ..."""
    force: bool = False
    """Build and send the job even when the planner says the run does not fit on its cards."""

    def cards(self) -> Optional[int]:
        """Cards per node the flavor gives (None: a flavor the kit does not know; MA_NUM_GPUS tells on the node)."""
        return POOL_FLAVOR_CARDS.get(self.flavor)

    def problems(self) -> list:
        """Every problem with the job settings, each naming the value and what to do."""
        p = []
        if not _OBS_DIR.match(self.obs_dir):
            p.append(
                f"OBS_DIR={self.obs_dir!r}: give the job's OBS folder, obs://bucket/folder/ (a bucket in the "
                "region of the job: 3-63 lower-case letters, digits, '.' or '-')."
            )
        for name in ("data_obs", "model_obs", "code_dir"):
            value = getattr(self, name)
            if value and not _OBS_DIR.match(value):
                p.append(f"{name.upper()}={value!r} is not an OBS folder, obs://bucket/folder/.")
        if self.nodes < 1:
            p.append(f"NODES={self.nodes} must be >= 1.")
        if not self.flavor:
            p.append("FLAVOR is empty: give the resource flavor, e.g. modelarts.pool.visual.8xlarge.")
        elif not _FLAVOR.match(self.flavor) or (
            self.flavor.startswith("modelarts.pool.") and self.flavor not in POOL_FLAVOR_CARDS
        ):
            p.append(
                f"FLAVOR={self.flavor!r} is not a ModelArts flavor: a dedicated pool's is one of "
                f"{', '.join(POOL_FLAVOR_CARDS)}; a public pool's is listed by the ModelArts console or the SDK's "
                "show_training_job_flavors (e.g. modelarts.p3.large.public)."
            )
        if self.image_url and not _IMAGE.match(self.image_url):
            p.append(
                f"IMAGE_URL={self.image_url!r} is not an SWR image: organization/name:tag or "
                "swr.<region>.myhuaweicloud.com/organization/name:tag, without spaces."
            )
        if self.flavor.startswith("modelarts.pool.") and not self.pool_id:
            p.append(
                f"FLAVOR={self.flavor!r} is a dedicated-pool flavor: set POOL_ID (ModelArts console, dedicated "
                "resource pools), or pick a public flavor."
            )
        engine = bool(self.engine_name or self.engine_version)
        if bool(self.image_url) == engine:
            p.append(
                "give either IMAGE_URL (an SWR image with the kit) or ENGINE_NAME + ENGINE_VERSION (a preset "
                f"engine), not {'both' if engine else 'neither'}."
            )
        if engine and not (self.engine_name and self.engine_version):
            p.append("a preset engine needs both ENGINE_NAME and ENGINE_VERSION.")
        if engine and not self.code_dir:
            p.append("a preset engine has no kit: upload this checkout to OBS and set CODE_DIR to it.")
        if self.launcher not in LAUNCHERS:
            p.append(f"LAUNCHER={self.launcher!r} is not one of {', '.join(LAUNCHERS)}.")
        if self.name and not _JOB_NAME.match(self.name):
            p.append(f"NAME={self.name!r}: 1-64 letters, digits, '_' or '-'.")
        if len(self.description) > 256:
            p.append(f"DESCRIPTION has {len(self.description)} characters; ModelArts allows 256.")
        bad = [
            k
            for k in self.environments
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k) or k.startswith("MA_")
        ]
        if bad:
            p.append(f"ENVIRONMENTS {bad}: names are letters, digits, '_' and must not start with MA_.")
        if len(self.environments) > 90:
            p.append(
                f"ENVIRONMENTS has {len(self.environments)} variables; ModelArts allows 100 with the kit's."
            )
        return p
