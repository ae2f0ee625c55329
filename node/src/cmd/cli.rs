//! Command-line interface. Every flag is documented here; `shoal <cmd> --help`
//! prints it.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use shoal_models::{ArchKind, DatasetKind, DeviceKind, OptimizerKind, Precision};

#[derive(Debug, Parser)]
#[command(name = "shoal", version, about = "Peer-to-peer training of neural networks", long_about = None)]
pub struct Cli {
    /// Log format on stderr. Filter with RUST_LOG (default: info).
    #[arg(long, value_enum, default_value_t = LogFormat::Pretty, global = true)]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Pretty,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model on this machine alone.
    Train(Box<TrainArgs>),
    /// Run one node of a cluster (the deployment form). See `docs/operations.md`.
    Node(Box<NodeArgs>),
    /// Start a 4-node cluster in this process on loopback TCP and train on the embedded digits.
    Demo(DemoArgs),
    /// Evaluate a model file on a data set's test split: loss and accuracy.
    Eval(EvalArgs),
    /// Sample text from a trained language model (a `--model llama` file or Hugging Face directory).
    Generate(GenerateArgs),
    /// Manage training data.
    Data {
        #[command(subcommand)]
        command: DataCommand,
    },
    /// Benchmarks; each prints ratios against a baseline measured in the same run.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
    /// A terminal view of the cluster through one node's HTTP endpoint:
    /// one row per node, keys to sort and select (works over SSH).
    Top(TopArgs),
    /// Local testnets with scripted faults. See `docs/operations.md`.
    Testnet {
        #[command(subcommand)]
        command: TestnetCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum TestnetCommand {
    /// Spawn `shoal node` processes on loopback, apply the scenario's
    /// timeline, show a live table and write a report directory.
    Run(TestnetRunArgs),
    /// Check a scenario file and print its timeline.
    Check {
        /// The scenario (TOML).
        scenario: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct TestnetRunArgs {
    /// The scenario (TOML); see testnet/scenarios/.
    pub scenario: PathBuf,
    /// Report directory (default: testnet-reports/<scenario>-<unix time>).
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// The `shoal` binary the nodes run (default: this one).
    #[arg(long)]
    pub shoal_bin: Option<PathBuf>,
    /// The aarch64 `shoal` binary that nodes with `arch = "aarch64"` run
    /// under qemu-aarch64 (build it with scripts/build-aarch64.sh).
    #[arg(long, env = "SHOAL_AARCH64_BIN")]
    pub aarch64_bin: Option<PathBuf>,
    /// Print the table every 5 s instead of redrawing it in place.
    #[arg(long)]
    pub no_live: bool,
    /// `processes` (on loopback) or `docker` (one container per node from
    /// --image, on a private network).
    #[arg(long, default_value = "processes")]
    pub backend: String,
    /// Docker backend: the image (build it with testnet/docker/build-image.sh).
    #[arg(long, default_value = "shoal:testnet")]
    pub image: String,
}

#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Model architecture: mlp, cnn or llama (llama is a transformer
    /// language model; it needs a text data set).
    #[arg(long, default_value = "mlp", value_parser = parse_arch)]
    pub model: ArchKind,
    /// Llama: transformer blocks.
    #[arg(long, default_value_t = shoal_models::LlamaSize::default().layers)]
    pub layers: usize,
    /// Llama: (query) attention heads per block.
    #[arg(long, default_value_t = shoal_models::LlamaSize::default().heads)]
    pub heads: usize,
    /// Llama: key/value heads per block, dividing --heads (default: 2 where
    /// it divides --heads, else --heads).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Llama: embedding width (--heads times an even head width).
    #[arg(long, default_value_t = shoal_models::LlamaSize::default().width)]
    pub width: usize,
    /// Llama: the SwiGLU MLP's hidden width.
    #[arg(long, default_value_t = shoal_models::LlamaSize::default().ff)]
    pub ff: usize,
    /// Llama: an output head of its own instead of the token embedding.
    #[arg(long)]
    pub untied: bool,
    /// Data set: `digits` is built in; `fashion-mnist` needs `shoal data
    /// fetch fashion-mnist`; `text:PATH` is any UTF-8 file, read in windows
    /// of 64 bytes or tokens (`text@N:PATH`: N); `tokens:DIR` (or
    /// `tokens@N:DIR`) is a token directory from `shoal data tokenize`.
    /// Text and tokens are for --model llama.
    #[arg(long, default_value = "digits", value_parser = parse_dataset)]
    pub dataset: DatasetKind,
    /// Where to look for downloaded data sets (default: ./data, then /usr/share/datasets).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json` to cut a `text:PATH` with (default:
    /// bytes). A token directory brings its own.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Total epochs to train (a resumed run continues up to this count).
    #[arg(long, default_value_t = 10)]
    pub epochs: u64,
    /// Total steps to train instead of --epochs (a resumed run continues up
    /// to this count); evaluates every --eval-every steps.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(1..))]
    pub steps: Option<u64>,
    /// With --steps: evaluate on the test (validation) split every this many steps.
    #[arg(long, default_value_t = 100, value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(1..))]
    pub eval_every: u64,
    /// Samples per step.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Learning rate (default: 2e-3 for adamw, 0.05 for sgd).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Optimizer: adamw, or sgd (momentum 0.9, Nesterov).
    #[arg(long, default_value = "adamw", value_parser = parse_optimizer)]
    pub optimizer: OptimizerKind,
    /// Weight decay (decoupled for adamw; default: 1e-4 for adamw, 0 for sgd).
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Steps of linear learning-rate warm-up (from lr/N up to lr).
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: u64,
    /// Learning-rate decay after the warm-up: none, or cosine (to lr/100 at
    /// the last step).
    #[arg(long, default_value = "none")]
    pub lr_decay: crate::config::LrDecay,
    /// Scale each step's gradient down to this global L2 norm when it is
    /// larger.
    #[arg(long)]
    pub clip_grad: Option<f64>,
    /// Micro-batches per step, their gradients averaged: a step of
    /// --batch-size samples holds the memory of --batch-size / N.
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub accumulate: usize,
    /// Seed for weight init and data order.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Compute device: cpu, cuda[:N] (feature `cuda`) or metal[:N] (feature `metal`).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceKind,
    /// The matrix products' dtype: f32, or bf16 (f32 weights and optimizer
    /// state; for GPUs: on the CPU bf16 is emulated and slower).
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: Precision,
    /// Save a safetensors checkpoint here after every epoch.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Resume from this checkpoint (model, optimizer state and data position).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Start from the weights of this model file (fine-tuning): fresh
    /// optimizer, step 0. Its model must match --model and the data set.
    #[arg(long, conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// Start from a Hugging Face Llama directory (`config.json` and
    /// `model.safetensors`, as `save_pretrained` writes them): its sizes
    /// replace --layers, --heads, --kv-heads, --width and --ff; fresh
    /// optimizer, step 0.
    #[arg(long, conflicts_with_all = ["resume", "init"])]
    pub init_hf: Option<PathBuf>,
    /// Write the trained model here at the end (safetensors, the model's own
    /// layer names; `shoal eval` and other software read it).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Write the run's final figures here as one JSON object: `steps`,
    /// `samples_per_sec`, `tokens_per_sec` (language models), `train_loss`
    /// (the last round's), `val_loss`, `perplexity` (language models),
    /// `bits_per_byte`, `accuracy`, `peak_rss_bytes`.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// --model llama: also write the trained model as a Hugging Face
    /// directory (`config.json`, `model.safetensors`,
    /// `generation_config.json`, and `tokenizer.json`: the data's tokenizer,
    /// or for bytes a byte-level one) that `LlamaForCausalLM.from_pretrained`
    /// and `AutoTokenizer` load.
    #[arg(long)]
    pub output_hf: Option<PathBuf>,
    /// Compute threads (default: every core; one for an MLP or CNN whose
    /// step's forward pass is under 64M multiply-adds, e.g. the MLP at batch 64).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub threads: Option<usize>,
}

/// `shoal generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The model file of a Llama or GPT (from `--output` of train, node,
    /// demo or testnet run), or a Hugging Face Llama directory.
    #[arg(long)]
    pub model: PathBuf,
    /// The text to continue.
    #[arg(long, default_value = "")]
    pub prompt: String,
    /// How many tokens (bytes, for a byte model) to generate.
    #[arg(long, default_value_t = 200)]
    pub tokens: usize,
    /// The `tokenizer.json` of a model over tokens (default: the one in the
    /// model's Hugging Face directory, or its token directory's).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Sampling temperature; 0 always takes the most likely byte.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Seed of the sampling: the same seed gives the same text.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Compute device.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceKind,
}

/// `shoal eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The model file (written by `--output` of train, node, demo or testnet run).
    #[arg(long)]
    pub model: PathBuf,
    /// Data set to evaluate on (default: the one the model was trained on).
    /// A text or token directory is evaluated whole, in consecutive windows.
    #[arg(long, value_parser = parse_dataset)]
    pub dataset: Option<DatasetKind>,
    /// Where to look for downloaded data sets (default: ./data, then /usr/share/datasets).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// The `tokenizer.json` that cuts a `text:PATH` for a model over tokens
    /// (default: the one in the model's Hugging Face directory).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Compute device.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceKind,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `shoal node`: the commonly changed fields of the config file can be overridden here
/// (the rest live only in the file; see testnet/node.example.toml).
#[derive(Debug, Args)]
pub struct NodeArgs {
    /// TOML config file (see testnet/node.example.toml). Without it, defaults apply.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A preset under the config file: `edge` (a small board: owns no
    /// shards, bounded frames and queues; docs/operations.md, "Edge devices").
    #[arg(long, value_enum)]
    pub profile: Option<crate::config::Profile>,
    /// Run name; nodes of different runs ignore each other.
    #[arg(long)]
    pub run_id: Option<String>,
    /// Node name for logs and status (default: the last 6 characters of the peer id).
    #[arg(long)]
    pub name: Option<String>,
    /// Identity file (32-byte ed25519 secret; created if missing; default: a fresh identity per start).
    #[arg(long)]
    pub identity: Option<PathBuf>,
    /// Listen multiaddr, repeatable: /ip4/0.0.0.0/tcp/7000 (TCP+noise+yamux) or /ip4/0.0.0.0/udp/7000/quic-v1 (QUIC).
    #[arg(long)]
    pub listen: Vec<shoal_protocol::libp2p::Multiaddr>,
    /// Bootstrap peer multiaddr with /p2p/<peer id>, repeatable.
    #[arg(long)]
    pub bootstrap: Vec<shoal_protocol::libp2p::Multiaddr>,
    /// Disable mDNS LAN discovery.
    #[arg(long)]
    pub no_mdns: bool,
    /// Relay to take a reservation on, repeatable
    /// (/ip4/../tcp/../p2p/<relay id>): peers that cannot dial this node reach
    /// it through the relay, and it reaches them the same way. Turns on the
    /// relay client and DCUtR hole punching.
    #[arg(long)]
    pub relay: Vec<shoal_protocol::libp2p::Multiaddr>,
    /// Serve as a circuit relay (v2) for peers that cannot reach each other.
    #[arg(long)]
    pub relay_server: bool,
    /// The model: mlp, cnn or llama (the last on a text or token data set).
    #[arg(long, value_parser = parse_arch)]
    pub model: Option<ArchKind>,
    /// The data set: digits (built in), fashion-mnist, text:PATH, text@N:PATH, tokens:DIR or tokens@N:DIR.
    #[arg(long, value_parser = parse_dataset)]
    pub dataset: Option<DatasetKind>,
    /// Where to look for downloaded data sets (default: ./data, then /usr/share/datasets).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json` for a `text:PATH` data set.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Samples per step on this node (nodes may differ: aggregation weights by samples).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// sgd (momentum 0.9, Nesterov) or adamw.
    #[arg(long, value_parser = parse_optimizer)]
    pub optimizer: Option<OptimizerKind>,
    /// Learning rate (default: 0.05 with sgd, 2e-3 with adamw).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Learning-rate decay: none, or cosine (to lr/100 over the steps).
    #[arg(long)]
    pub lr_decay: Option<crate::config::LrDecay>,
    /// Steps of linear warm-up from 0 to the learning rate, before the decay.
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// The optimizer's weight decay (SGD: L2; AdamW: decoupled).
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Seed of the weight init and the data order.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Training steps this worker takes.
    #[arg(long)]
    pub steps: Option<u64>,
    /// cpu, cuda[:N] or metal[:N] (the last two need a build with that feature).
    #[arg(long, value_parser = parse_device)]
    pub device: Option<DeviceKind>,
    /// The matrix products' dtype: f32, or bf16 (f32 weights and optimizer
    /// state; for GPUs: on the CPU bf16 is emulated and slower).
    #[arg(long, value_parser = parse_dtype)]
    pub dtype: Option<Precision>,
    /// pull (shard owners) or gossip.
    #[arg(long)]
    pub mode: Option<crate::config::Mode>,
    /// bsp, ssp:N, dssp:LO-HI or asp.
    #[arg(long)]
    pub sync: Option<crate::policy::sync::SyncPolicy>,
    /// Start training once this many nodes agree on the roster.
    #[arg(long)]
    pub min_peers: Option<usize>,
    /// Shards the model is cut into.
    #[arg(long)]
    pub shards: Option<u32>,
    /// Whether this node may own shards.
    #[arg(long)]
    pub can_aggregate: Option<bool>,
    /// How often this node gossips its heartbeat, in ms.
    #[arg(long)]
    pub heartbeat_ms: Option<u64>,
    /// A peer silent this long (ms) has failed: its shards move.
    #[arg(long)]
    pub failure_timeout_ms: Option<u64>,
    /// How long (ms) to wait for the roster of --min-peers nodes before giving up.
    #[arg(long)]
    pub start_timeout_ms: Option<u64>,
    /// Elastic roles: demote slow owners and move their shards (true/false).
    #[arg(long)]
    pub elastic: Option<bool>,
    /// Shard owners: auto (explore the number, as in PSLD), all, or a count.
    #[arg(long)]
    pub aggregators: Option<crate::config::Aggregators>,
    /// With --aggregators auto: how many to start from (0: every capable node).
    #[arg(long)]
    pub start_aggregators: Option<u16>,
    /// Copies of each shard: 1 or 2.
    #[arg(long)]
    pub replicas: Option<u32>,
    /// Replicate each shard every this many versions.
    #[arg(long)]
    pub replica_every: Option<u64>,
    /// Fault injection: answer pushes and pulls this many ms late.
    #[arg(long)]
    pub fault_delay_ms: Option<u64>,
    /// Fault injection: stretch each gradient computation this many times.
    #[arg(long)]
    pub slowdown: Option<f64>,
    /// Fault injection: serve shard states over an emulated link of this many Mbit/s.
    #[arg(long)]
    pub fault_serve_mbps: Option<f64>,
    /// Compute the next step while this step's exchange is on the wire (ssp:N with N >= 1, dssp, asp).
    #[arg(long)]
    pub overlap: Option<bool>,
    /// Local steps between pushes of a pseudo-gradient (DiLoCo; 1: none).
    #[arg(long)]
    pub local_steps: Option<u64>,
    /// Link emulation: this node's link runs at this many Mbit/s each way (0: none).
    #[arg(long)]
    pub link_mbps: Option<f64>,
    /// Link emulation: one-way latency of every message this node sends, in ms.
    #[arg(long)]
    pub link_latency_ms: Option<f64>,
    /// How owners combine a BSP round: mean, trimmed_mean:F, median, centered_clip:TAU or nnm:F.
    #[arg(long)]
    pub aggregation: Option<crate::policy::robust::Aggregation>,
    /// Owners reject gradients over this many times the median norm (0: off; default: 50 under BSP, off otherwise).
    #[arg(long)]
    pub norm_check: Option<f32>,
    /// Owners also reject gradients under the median norm divided by this, as pushes of zeros (0: off, the default).
    #[arg(long)]
    pub norm_floor: Option<f32>,
    /// Fault injection: push bad gradients: none, scale:F, sign_flip, random, zeros, stale:K, replay, copy or alie:Z.
    #[arg(long)]
    pub fault_byzantine: Option<crate::ops::faults::Byzantine>,
    /// Gradient pushes: none, bf16, int8, topk:FRACTION (lossy ones with error feedback) or sfb (sufficient factors).
    #[arg(long)]
    pub compress_push: Option<crate::policy::compress::PushCompression>,
    /// Parameter pulls: none or bf16.
    #[arg(long)]
    pub compress_pull: Option<crate::policy::compress::PullCompression>,
    /// Serve the status page, /status and /metrics on host:port, or `off`
    /// (default: 127.0.0.1:0, loopback on a free port).
    #[arg(long)]
    pub http: Option<String>,
    /// Serve POST /control/... on the HTTP endpoint (testnets only).
    #[arg(long)]
    pub control: bool,
    /// Write the trained model here (safetensors) when the node finishes or leaves.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// A Llama: also write the trained model as a Hugging Face directory.
    #[arg(long)]
    pub output_hf: Option<PathBuf>,
    /// Write shard checkpoints into this folder, and resume from it after a full stop.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Print the config that the file, the profile and these flags make,
    /// every key with its value (the defaults included), and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// `shoal demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Nodes in the cluster.
    #[arg(long, default_value_t = 4)]
    pub nodes: usize,
    /// Training steps per node.
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    /// bsp, ssp:N, dssp:LO-HI or asp.
    #[arg(long, default_value = "bsp")]
    pub sync: crate::policy::sync::SyncPolicy,
    /// pull (shard owners) or gossip.
    #[arg(long, default_value = "pull")]
    pub mode: crate::config::Mode,
    /// The model: mlp, cnn or llama (the last on a text or token data set).
    #[arg(long, default_value = "mlp", value_parser = parse_arch)]
    pub model: ArchKind,
    /// The data set: digits (built in), fashion-mnist, text:PATH, text@N:PATH, tokens:DIR or tokens@N:DIR.
    #[arg(long, default_value = "digits", value_parser = parse_dataset)]
    pub dataset: DatasetKind,
    /// Where to look for downloaded data sets (default: ./data, then /usr/share/datasets).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Samples per step on each node.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Learning rate of the SGD (default 0.15, decayed by --lr-decay; 0.05 with --local-steps above 1).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Learning-rate decay: cosine (to lr/100 over the steps), or none.
    #[arg(long, default_value = "cosine")]
    pub lr_decay: crate::config::LrDecay,
    /// Seed of weight init and data order.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Shards the model is cut into.
    #[arg(long, default_value_t = 8)]
    pub shards: u32,
    /// Write the first node's trained model here (safetensors).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// --model llama: also write the first node's trained model as a
    /// Hugging Face directory (as `shoal train --output-hf`).
    #[arg(long)]
    pub output_hf: Option<PathBuf>,
    /// Compute threads per node (default: this host's cores / --nodes).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub threads: Option<usize>,
    /// Every node's gradient pushes: none, bf16, int8, topk:FRACTION (lossy ones with error feedback) or sfb.
    #[arg(long, default_value = "none")]
    pub compress_push: crate::policy::compress::PushCompression,
    /// Every node's parameter pulls: none or bf16.
    #[arg(long, default_value = "none")]
    pub compress_pull: crate::policy::compress::PullCompression,
    /// Compute the next step while this step's exchange is on the wire (ssp:N with N >= 1, dssp, asp).
    #[arg(long)]
    pub overlap: bool,
    /// Local steps between pushes of a pseudo-gradient (DiLoCo; 1: none).
    #[arg(long, default_value_t = 1)]
    pub local_steps: u64,
    /// A third of the way in, one shard owner starts answering every push
    /// and pull this many ms late (25 when given alone); at the end, who
    /// was demoted, when, how long its shards took to move, and the
    /// cluster's speed before, during and after (pull mode, elastic roles;
    /// 0: no straggler).
    #[arg(long, num_args = 0..=1, default_value_t = 0, default_missing_value = "25")]
    pub straggler: u64,
}

/// `shoal top`.
#[derive(Debug, Args)]
pub struct TopArgs {
    /// The HTTP address of any node of the cluster (`status on http://HOST:PORT/` in its output).
    #[arg(long)]
    pub node: String,
    /// How often to read it, in ms.
    #[arg(long, default_value_t = 1000)]
    pub interval_ms: u64,
}

#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Make a data set available locally and verify it.
    Fetch(FetchArgs),
    /// Train a byte-level BPE tokenizer on local text files and write it as
    /// a Hugging Face `tokenizer.json` (for a cluster that cannot download
    /// one from a hub).
    TrainTokenizer(TrainTokenizerArgs),
    /// Tokenize UTF-8 text files into a token directory for `--dataset
    /// tokens:DIR`: shards of u16 (or u32) token ids and an index with the
    /// counts and a content hash.
    Tokenize(TokenizeArgs),
}

#[derive(Debug, Args)]
pub struct TrainTokenizerArgs {
    /// Tokens in the vocabulary, the 256 byte symbols and `<|endoftext|>`
    /// included.
    #[arg(long, default_value_t = 8192)]
    pub vocab: usize,
    /// Where to write the `tokenizer.json`.
    #[arg(long)]
    pub output: PathBuf,
    /// UTF-8 text files to learn the merges from.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
}

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// The `tokenizer.json` to cut the text with (copied into the directory).
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// The token directory to write (it must not hold a token set already).
    #[arg(long)]
    pub output: PathBuf,
    /// UTF-8 text files, one document each, in this order.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FetchableDataset {
    FashionMnist,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FetchMethod {
    /// `apt-get install` when root, else download-and-extract.
    Auto,
    /// `apt-get install -y dataset-fashion-mnist` (needs root).
    AptInstall,
    /// `apt-get download` then `dpkg-deb -x` into --dest (no root needed).
    Download,
}

#[derive(Debug, Args)]
pub struct FetchArgs {
    /// The data set to install.
    #[arg(value_enum)]
    pub dataset: FetchableDataset,
    /// How to get it.
    #[arg(long, value_enum, default_value_t = FetchMethod::Auto)]
    pub method: FetchMethod,
    /// Where `download` extracts to.
    #[arg(long, default_value = "data")]
    pub dest: PathBuf,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Single-node training throughput (MLP, CNN) and matmul against a naive baseline.
    Train(BenchTrainArgs),
    /// Shard transfer over TCP+noise+yamux and QUIC against raw TCP; payload codecs against memcpy.
    Wire(BenchWireArgs),
    /// In-process clusters of 1, 2 and 4 nodes on loopback TCP, and an aggregation-bound 25M-parameter case.
    Cluster(BenchClusterArgs),
    /// One aggregator slowed 5x: no straggler vs. static roles vs. elastic roles (4 nodes, digits).
    Straggler(BenchStragglerArgs),
    /// Number of aggregators: one fixed owner vs. exploring from one (PSLD) vs. every node (4 nodes, digits).
    Aggregators(BenchAggregatorsArgs),
    /// One shard checkpoint (encode, write, fsync, rename) against a raw write+fsync of its bytes.
    Checkpoint(BenchCheckpointArgs),
    /// Compression, overlap and DiLoCo against f32 BSP at emulated link rates: bytes, hidden communication, accuracy.
    Comm(BenchCommArgs),
    /// Push and pull of a 100 MB model across 4 nodes (the exchange of an all-reduce) against raw TCP.
    Exchange(BenchExchangeArgs),
    /// Bad peers among honest ones: honest accuracy under each attack and aggregation rule against a fault-free run.
    Robust(BenchRobustArgs),
}

#[derive(Debug, Args)]
pub struct BenchRobustArgs {
    /// Nodes in each cluster.
    #[arg(long, default_value_t = 10)]
    pub nodes: usize,
    /// How many of them attack (they own no shard); fewer than half.
    #[arg(long, default_value_t = 3)]
    pub byzantine: usize,
    /// Steps per node in each cluster.
    #[arg(long, default_value_t = 400)]
    pub steps: u64,
    /// Samples per step per node.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// The attacks, each pushed by every bad peer (`faults.byzantine` values).
    #[arg(long, value_delimiter = ',', default_value = "sign_flip,scale:100,random,zeros,stale:20,replay,copy,alie:1")]
    pub attacks: Vec<crate::ops::faults::Byzantine>,
    /// The aggregation rules to measure under each attack (`aggregation.rule` values).
    #[arg(long, value_delimiter = ',', default_value = "mean,trimmed_mean:0.3,median,centered_clip:0.01,nnm:0.3")]
    pub rules: Vec<crate::policy::robust::Aggregation>,
    /// The owners' norm check (`aggregation.norm_check`): 0 is off, so that each rule is measured alone.
    #[arg(long, default_value_t = 0.0)]
    pub norm_check: f32,
    /// The owners' norm floor (`aggregation.norm_floor`): 0 is off.
    #[arg(long, default_value_t = 0.0)]
    pub norm_floor: f32,
    /// The owners' contribution check (`aggregation.min_agreement`): leave out
    /// a worker whose gradients' moving cosine with the rounds' aggregates is
    /// below this. Off unless given.
    #[arg(long)]
    pub min_agreement: Option<f32>,
    /// Clusters per cell (the fault-free run included), each with other
    /// identities and so other data slices: the figure is their mean.
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// Also write the numbers as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct BenchExchangeArgs {
    /// Nodes in the cluster (each a worker and an owner).
    #[arg(long, default_value_t = 4)]
    pub nodes: usize,
    /// Model size in MB (10^6 bytes of f32 parameters).
    #[arg(long, default_value_t = 100.0)]
    pub mb: f64,
    /// Steps per node (the first, with its connection set-up, included).
    #[arg(long, default_value_t = 8)]
    pub steps: u64,
    /// Shards the model is split into.
    #[arg(long, default_value_t = 16)]
    pub shards: u32,
    /// Cases to run: `f32` (lossless), `int8` (int8 pushes with error
    /// feedback, bf16 pulls) and `sparse` (`sparseloco:0.015` pushes, bf16
    /// pulls).
    #[arg(long, value_delimiter = ',', default_value = "f32,int8,sparse")]
    pub cases: Vec<String>,
    /// Also write the numbers as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct BenchCommArgs {
    /// What the nodes train: mlp (every way of communicating, on an MLP)
    /// or llama (bytes against loss on a Llama: dense, DiLoCo, int8 and
    /// SparseLoCo-class pushes).
    #[arg(long, value_enum, default_value_t = CommWorkload::Mlp)]
    pub workload: CommWorkload,
    /// Steps per node in each case.
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    /// Samples per step per node (default: 64 images for mlp, 8 windows for llama).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Evaluate every this many steps (for time to target accuracy).
    #[arg(long, default_value_t = 25)]
    pub eval_every: u64,
    /// Target test accuracy (default: 0.80 on Fashion-MNIST, 0.93 on digits).
    #[arg(long)]
    pub target: Option<f32>,
    /// Emulated link rates to run every case at, in Mbit/s per node and
    /// direction (0: loopback only; default: 1000,100 for mlp, 100 for llama).
    #[arg(long, value_delimiter = ',')]
    pub links: Vec<f64>,
    /// One-way latency of the emulated links, in ms.
    #[arg(long, default_value_t = 1.0)]
    pub latency_ms: f64,
    /// Run only these cases (comma-separated names as printed, for example
    /// `sfb`); the baseline (f32 bsp; dense for llama) always runs. Default: all.
    #[arg(long, value_delimiter = ',')]
    pub cases: Vec<String>,
    /// Where to look for downloaded data sets (default: ./data, then /usr/share/datasets).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// llama: the UTF-8 text to train on, as bytes (default: the text
    /// built into the binary, 35 KB: a few hundred steps before it is
    /// learnt by heart).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// llama: also draw bytes against held-out loss, one dot per case and
    /// link, as a PNG to this file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Also write the numbers as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// What `shoal bench comm` trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CommWorkload {
    Mlp,
    Llama,
}

#[derive(Debug, Args)]
pub struct BenchCheckpointArgs {
    /// Shard size in MB (10^6 bytes of parameters; the file also holds the optimizer state).
    #[arg(long, default_value_t = 100)]
    pub shard_mb: usize,
    /// Writes of each kind (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Folder to write in (default: the system's temporary folder).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Also write the numbers as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct BenchAggregatorsArgs {
    /// Steps per node in each case.
    #[arg(long, default_value_t = 600)]
    pub steps: u64,
    /// Samples per step per node.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Hidden layer widths of the MLP (a large model makes aggregation costly).
    #[arg(long, value_delimiter = ',', default_value = "256,256")]
    pub hidden: Vec<usize>,
    /// Steps per measurement window of the explorer.
    #[arg(long, default_value_t = 40)]
    pub window: u64,
    /// Every owner serves shard states over an emulated uplink of this many
    /// Mbit/s (0: loopback as it is); a slow uplink makes a single owner the bottleneck.
    #[arg(long, default_value_t = 100.0)]
    pub serve_mbps: f64,
    /// Also write the numbers as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct BenchStragglerArgs {
    /// Steps per node in each case.
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Samples per step per node.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// How much slower the straggling aggregator makes a step under static
    /// roles (with --worker: how many times slower node3 computes).
    #[arg(long, default_value_t = 5.0)]
    pub slowdown: f64,
    /// A slow worker instead of a slow owner: node3 computes --slowdown
    /// times slower; BSP waiting for it against `sync.fit_batch` (shrink
    /// only, and rebalanced over the other workers), DSSP, and one backup
    /// worker (`sync.backup_workers`).
    #[arg(long)]
    pub worker: bool,
    /// Also write the numbers as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct BenchClusterArgs {
    /// Steps per node in the scaling runs.
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    /// Samples per step per node.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Evaluate every this many steps (for time to target accuracy).
    #[arg(long, default_value_t = 25)]
    pub eval_every: u64,
    /// Target test accuracy (default: 0.80 on Fashion-MNIST, 0.95 on digits).
    #[arg(long)]
    pub target: Option<f32>,
    /// Steps of the aggregation-bound case.
    #[arg(long, default_value_t = 5)]
    pub big_steps: u64,
    /// Skip the aggregation-bound case.
    #[arg(long)]
    pub skip_big: bool,
    /// Where to look for downloaded data sets (default: ./data, then /usr/share/datasets).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Also write the numbers as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct BenchWireArgs {
    /// Shard size in MB (10^6 bytes).
    #[arg(long, default_value_t = 100)]
    pub shard_mb: usize,
    /// Skip the QUIC transfer.
    #[arg(long)]
    pub skip_quic: bool,
    /// Skip the codec measurements.
    #[arg(long)]
    pub skip_codecs: bool,
    /// Also write the numbers as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct BenchTrainArgs {
    /// Timed training steps per model (after warm-up).
    #[arg(long, default_value_t = 100)]
    pub steps: usize,
    /// Samples per step.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Square matrix size for the matmul comparison.
    #[arg(long, default_value_t = 256)]
    pub matmul_size: usize,
    /// Only this model: mlp, cnn or llama (default: all three).
    #[arg(long, value_parser = parse_arch)]
    pub model: Option<ArchKind>,
    /// Where to look for Fashion-MNIST (digits are used if it is absent).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Compute device.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceKind,
    /// The matrix products' dtype of the training rows: f32 or bf16.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: Precision,
    /// Compute threads (default: every core).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub threads: Option<usize>,
    /// Also write the numbers as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

fn parse_arch(s: &str) -> Result<ArchKind, String> {
    s.parse().map_err(|e: shoal_models::ModelError| e.to_string())
}

fn parse_dataset(s: &str) -> Result<DatasetKind, String> {
    s.parse().map_err(|e: shoal_models::ModelError| e.to_string())
}

fn parse_optimizer(s: &str) -> Result<OptimizerKind, String> {
    s.parse().map_err(|e: shoal_models::ModelError| e.to_string())
}

fn parse_device(s: &str) -> Result<DeviceKind, String> {
    s.parse().map_err(|e: shoal_models::ModelError| e.to_string())
}

fn parse_dtype(s: &str) -> Result<Precision, String> {
    s.parse().map_err(|e: shoal_models::ModelError| e.to_string())
}

impl TrainArgs {
    /// The Llama size the flags give.
    pub fn llama_size(&self) -> shoal_models::LlamaSize {
        let d = shoal_models::LlamaSize::default();
        let kv_heads =
            self.kv_heads.unwrap_or(if self.heads.is_multiple_of(d.kv_heads) { d.kv_heads } else { self.heads });
        shoal_models::LlamaSize {
            layers: self.layers,
            heads: self.heads,
            kv_heads,
            width: self.width,
            ff: self.ff,
            tie: !self.untied,
            ..d
        }
    }
}
