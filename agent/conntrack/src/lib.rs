//! The node's conntrack table over ctnetlink (`NETLINK_NETFILTER`): the TCP entries
//! skewless needs to find the backend behind a DNATed Service VIP.
//!
//! Messages are built and decoded with the rust-netlink crates (`netlink-packet-netfilter`,
//! `netlink-sys`); this crate only adds what skewless asks: [`Session::lookup`] (one GET per
//! original tuple, sent in batches), [`Session::dump`] (the whole table), [`Session::create`]
//! (entries without traffic, for benchmarks and tests) and [`decode`], which checks every
//! length a datagram declares.
//!
//! Its own crate because its dependencies are netlink's, not aya's: `skewless-datapath`
//! re-exports it as `skewless_datapath::conntrack` with the resolver that joins it to the
//! `sock_ops` connection records; fuzzing it needs no eBPF build.

#![forbid(unsafe_code)]

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
    conntrack::{
        ConntrackAttribute, ConntrackMessage, IPTuple, ProtoInfo, ProtoInfoTCP, ProtoTuple,
        Protocol, Tuple,
    },
};
use netlink_sys::{Socket, SocketAddr as NetlinkAddr, protocols::NETLINK_NETFILTER};

/// Most requests sent in one `send` before their answers are read.
const BATCH: usize = 256;
/// What one answer costs the receive buffer: the kernel allocates a GET's answer with room
/// for a default-size message (about a page), and the buffer counts allocated bytes. A batch
/// whose answers do not fit is lost (ENOBUFS), so batches are sized from the buffer.
const ANSWER_COST: usize = 8 * 1024;
/// Receive buffer asked for (SO_RCVBUFFORCE, with CAP_NET_ADMIN): room for a full batch.
const RCVBUF: usize = 4 * 1024 * 1024;
/// Receive buffer for one datagram. The kernel fills dump datagrams up to 32 KiB.
const RECV_BUF: usize = 64 * 1024;
/// `TCP_CONNTRACK_ESTABLISHED` (include/uapi/linux/netfilter/nf_conntrack_tcp.h).
const TCP_CONNTRACK_ESTABLISHED: u8 = 3;
/// Message types below this are netlink's own (NOOP, ERROR, DONE, OVERRUN).
const NLMSG_MIN_TYPE: u16 = 0x10;
/// `NFNL_SUBSYS_CTNETLINK`: the high byte of a conntrack message's type.
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const ENOENT: i32 = 2;
const EEXIST: i32 = 17;

/// Errors from reading the conntrack table.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("opening a netlink conntrack socket")]
    Socket(#[source] std::io::Error),
    #[error("entering network namespace {path}")]
    Netns {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("sending a conntrack request")]
    Send(#[source] std::io::Error),
    #[error("reading conntrack answers")]
    Recv(#[source] std::io::Error),
    #[error("the kernel refused a conntrack request")]
    Kernel(#[source] std::io::Error),
    #[error("malformed netlink message at byte {offset}")]
    Decode {
        offset: usize,
        #[source]
        source: netlink_packet_core::DecodeError,
    },
    #[error("netlink message at byte {offset} declares {declared} bytes, {left} left")]
    Length {
        offset: usize,
        declared: usize,
        left: usize,
    },
}

/// Where to read conntrack from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Conntrack {
    netns: Option<PathBuf>,
}

impl Conntrack {
    /// The network namespace of the calling process (the agent runs in the node's).
    #[must_use]
    pub fn here() -> Self {
        Self { netns: None }
    }

    /// Another network namespace, given as a path such as `/run/netns/<name>` (needs
    /// CAP_SYS_ADMIN). The socket is opened there once; it stays bound to that namespace.
    #[must_use]
    pub fn in_netns(path: impl Into<PathBuf>) -> Self {
        Self {
            netns: Some(path.into()),
        }
    }

    /// Opens a ctnetlink socket in the namespace.
    ///
    /// # Errors
    /// When the socket cannot be opened or the namespace entered.
    pub fn open(&self) -> Result<Session, Error> {
        let socket = match &self.netns {
            None => socket()?,
            Some(path) => {
                // setns changes only the calling thread: do it on a thread of our own, which
                // ends right after, so no other code ever runs in the other namespace.
                let path = path.clone();
                std::thread::scope(|s| {
                    s.spawn(|| {
                        let ns = std::fs::File::open(&path).map_err(|source| Error::Netns {
                            path: path.clone(),
                            source,
                        })?;
                        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(
                            |e| Error::Netns {
                                path: path.clone(),
                                source: e.into(),
                            },
                        )?;
                        socket()
                    })
                    .join()
                    .unwrap_or_else(|_| {
                        Err(Error::Socket(std::io::Error::other(
                            "netns thread panicked",
                        )))
                    })
                })?
            }
        };
        Ok(Session {
            batch: batch_size(&socket),
            socket,
            seq: 0,
            buf: vec![0; RECV_BUF],
        })
    }

    /// Dumps the TCP entries of the table, IPv4 and IPv6.
    ///
    /// # Errors
    /// When the socket cannot be opened or the dump fails (no privileges, no conntrack).
    pub fn dump(&self) -> Result<NatTable, Error> {
        self.open()?.dump()
    }
}

fn socket() -> Result<Socket, Error> {
    let mut s = Socket::new(NETLINK_NETFILTER).map_err(Error::Socket)?;
    s.bind_auto().map_err(Error::Socket)?;
    s.connect(&NetlinkAddr::new(0, 0)).map_err(Error::Socket)?;
    // Errors then quote only the request's header, not the whole request.
    s.set_cap_ack(true).map_err(Error::Socket)?;
    // Without CAP_NET_ADMIN the default buffer stays, and batches are smaller.
    let _ = nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::RcvBufForce, &RCVBUF);
    Ok(s)
}

/// Requests per batch that the socket's receive buffer can answer without loss.
fn batch_size(socket: &Socket) -> usize {
    // The kernel reports twice what it was set to (the other half is its bookkeeping).
    let rcvbuf = nix::sys::socket::getsockopt(socket, nix::sys::socket::sockopt::RcvBuf)
        .unwrap_or(200 * 1024)
        / 2;
    (rcvbuf / ANSWER_COST).clamp(4, BATCH)
}

/// One conntrack entry as skewless needs it: original source and destination, and the source
/// of the reply direction (the backend when the destination was DNATed). The reply's
/// destination is the original source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub reply_src: SocketAddr,
}

/// One decoded netlink message from the conntrack socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// A TCP entry (answer to a GET, or one of a dump).
    Entry { seq: u32, entry: Entry },
    /// A conntrack message that is not a complete TCP entry (another protocol, a tuple
    /// missing): skipped.
    Skipped { seq: u32 },
    /// The request with this sequence number succeeded (0) or failed (a negative errno).
    Status { seq: u32, errno: i32 },
    /// End of a dump.
    Done { seq: u32 },
}

/// Decodes every netlink message of one datagram. Every length the datagram declares is
/// checked against what is there; nothing is trusted.
///
/// # Errors
/// When a message's length is impossible or its contents do not decode.
pub fn decode(buf: &[u8]) -> Result<Vec<Reply>, Error> {
    const HEADER: usize = 16;
    let mut out = Vec::new();
    let mut offset = 0;
    while buf.len() - offset >= HEADER {
        let left = buf.len() - offset;
        let declared = u32::from_ne_bytes([
            buf[offset],
            buf[offset + 1],
            buf[offset + 2],
            buf[offset + 3],
        ]) as usize;
        if declared < HEADER || declared > left {
            return Err(Error::Length {
                offset,
                declared,
                left,
            });
        }
        // Only ctnetlink (and netlink's own control messages) is handed to the decoder: the
        // netfilter crate's other subsystems are not ours to parse, and its nftables parser
        // panics on attribute lengths under 4 (found by the fuzz target).
        let kind = u16::from_ne_bytes([buf[offset + 4], buf[offset + 5]]);
        if kind >= NLMSG_MIN_TYPE && kind >> 8 != NFNL_SUBSYS_CTNETLINK {
            out.push(Reply::Skipped {
                seq: u32::from_ne_bytes([
                    buf[offset + 8],
                    buf[offset + 9],
                    buf[offset + 10],
                    buf[offset + 11],
                ]),
            });
            offset += declared.next_multiple_of(4).min(left);
            continue;
        }
        let msg = NetlinkMessage::<NetfilterMessage>::deserialize(&buf[offset..offset + declared])
            .map_err(|source| Error::Decode { offset, source })?;
        let seq = msg.header.sequence_number;
        match msg.payload {
            NetlinkPayload::Error(e) => out.push(Reply::Status {
                seq,
                errno: e.raw_code(),
            }),
            NetlinkPayload::Done(_) => out.push(Reply::Done { seq }),
            NetlinkPayload::InnerMessage(NetfilterMessage {
                inner:
                    NetfilterMessageInner::Conntrack(
                        ConntrackMessage::New(attrs) | ConntrackMessage::Get(attrs),
                    ),
                ..
            }) => out.push(match entry_of(&attrs) {
                Some(entry) => Reply::Entry { seq, entry },
                None => Reply::Skipped { seq },
            }),
            _ => out.push(Reply::Skipped { seq }),
        }
        // Messages are 4-byte aligned within a datagram.
        offset += declared.next_multiple_of(4).min(left);
    }
    Ok(out)
}

/// The TCP entry an attribute list describes, if it has both tuples.
fn entry_of(attrs: &[ConntrackAttribute]) -> Option<Entry> {
    let mut orig = None;
    let mut reply = None;
    for a in attrs {
        match a {
            ConntrackAttribute::CtaTupleOrig(t) => orig = tuple_of(t),
            ConntrackAttribute::CtaTupleReply(t) => reply = tuple_of(t),
            _ => {}
        }
    }
    let ((src, dst), (reply_src, _)) = (orig?, reply?);
    Some(Entry {
        src,
        dst,
        reply_src,
    })
}

/// (source, destination) of a TCP tuple whose addresses are of one family.
fn tuple_of(tuple: &[Tuple]) -> Option<(SocketAddr, SocketAddr)> {
    let (mut sip, mut dip, mut sport, mut dport, mut tcp) = (None, None, None, None, false);
    for t in tuple {
        match t {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => sip = Some(*a),
                        IPTuple::DestinationAddress(a) => dip = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(protos) => {
                for p in protos {
                    match p {
                        ProtoTuple::Protocol(proto) => tcp = *proto == Protocol::Tcp,
                        ProtoTuple::SourcePort(port) => sport = Some(*port),
                        ProtoTuple::DestinationPort(port) => dport = Some(*port),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    let (sip, dip): (IpAddr, IpAddr) = (sip?, dip?);
    if !tcp || sip.is_ipv6() != dip.is_ipv6() {
        return None;
    }
    Some((SocketAddr::new(sip, sport?), SocketAddr::new(dip, dport?)))
}

fn tuple_attrs(src: SocketAddr, dst: SocketAddr) -> Vec<Tuple> {
    vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(src.ip()),
            IPTuple::DestinationAddress(dst.ip()),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(Protocol::Tcp),
            ProtoTuple::SourcePort(src.port()),
            ProtoTuple::DestinationPort(dst.port()),
        ]),
    ]
}

fn family(addr: SocketAddr) -> NetfilterProtoFamily {
    if addr.is_ipv6() {
        NetfilterProtoFamily::IPv6
    } else {
        NetfilterProtoFamily::IPv4
    }
}

/// An open ctnetlink socket.
#[derive(Debug)]
pub struct Session {
    socket: Socket,
    batch: usize,
    seq: u32,
    buf: Vec<u8>,
}

impl Session {
    /// Dumps the TCP entries of the table, IPv4 and IPv6 (one dump: family `AF_UNSPEC`).
    ///
    /// # Errors
    /// When the request fails or an answer does not decode.
    pub fn dump(&mut self) -> Result<NatTable, Error> {
        let seq = self.next_seq();
        let mut out = Vec::new();
        push_message(
            &mut out,
            NLM_F_REQUEST | NLM_F_DUMP,
            seq,
            NetfilterProtoFamily::Unspec,
            ConntrackMessage::Get(vec![]),
        );
        self.socket.send(&out, 0).map_err(Error::Send)?;
        let mut table = NatTable::default();
        loop {
            for reply in self.recv()? {
                match reply {
                    Reply::Entry { seq: s, entry } if s == seq => {
                        table
                            .by_original
                            .insert((entry.src, entry.dst), entry.reply_src);
                    }
                    Reply::Done { seq: s } if s == seq => return Ok(table),
                    Reply::Status { seq: s, errno } if s == seq && errno != 0 => {
                        return Err(Error::Kernel(std::io::Error::from_raw_os_error(-errno)));
                    }
                    _ => {}
                }
            }
        }
    }

    /// The reply source of each original tuple (source, destination), `None` where the table
    /// has no such TCP entry. One GET per tuple, sent in batches of up to 256.
    ///
    /// # Errors
    /// When a request fails for another reason than a missing entry, or an answer does not
    /// decode.
    pub fn lookup(
        &mut self,
        tuples: &[(SocketAddr, SocketAddr)],
    ) -> Result<Vec<Option<SocketAddr>>, Error> {
        let mut found = vec![None; tuples.len()];
        let batch = self.batch;
        for (chunk_no, chunk) in tuples.chunks(batch).enumerate() {
            let base = chunk_no * batch;
            let answers = self.batch(chunk.len(), |out, i, seq| {
                let (src, dst) = chunk[i];
                push_message(
                    out,
                    NLM_F_REQUEST,
                    seq,
                    family(src),
                    ConntrackMessage::Get(vec![ConntrackAttribute::CtaTupleOrig(tuple_attrs(
                        src, dst,
                    ))]),
                );
            })?;
            for (i, answer) in answers.into_iter().enumerate() {
                match answer {
                    (_, Some(entry)) => found[base + i] = Some(entry.reply_src),
                    (0 | ENOENT, None) => {}
                    (errno, None) => {
                        return Err(Error::Kernel(std::io::Error::from_raw_os_error(errno)));
                    }
                }
            }
        }
        Ok(found)
    }

    /// Creates ESTABLISHED TCP entries that expire after `timeout` (benchmarks and tests fill
    /// a table with them; they carry no traffic). An entry that exists already is left alone.
    ///
    /// # Errors
    /// When the kernel refuses an entry for another reason than that, e.g. a full table.
    pub fn create(&mut self, entries: &[Entry], timeout: Duration) -> Result<(), Error> {
        let secs = u32::try_from(timeout.as_secs()).unwrap_or(u32::MAX).max(1);
        for chunk in entries.chunks(self.batch) {
            let answers = self.batch(chunk.len(), |out, i, seq| {
                let e = chunk[i];
                push_message(
                    out,
                    NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL,
                    seq,
                    family(e.src),
                    ConntrackMessage::New(vec![
                        ConntrackAttribute::CtaTupleOrig(tuple_attrs(e.src, e.dst)),
                        ConntrackAttribute::CtaTupleReply(tuple_attrs(e.reply_src, e.src)),
                        ConntrackAttribute::CtaProtoInfo(vec![ProtoInfo::TCP(vec![
                            ProtoInfoTCP::State(TCP_CONNTRACK_ESTABLISHED),
                        ])]),
                        ConntrackAttribute::CtaTimeout(secs),
                    ]),
                );
            })?;
            if let Some((errno, _)) = answers
                .iter()
                .find(|(errno, _)| *errno != 0 && *errno != EEXIST)
            {
                return Err(Error::Kernel(std::io::Error::from_raw_os_error(*errno)));
            }
        }
        Ok(())
    }

    /// Sends `n` requests (built by `build(out, index, seq)`, without `NLM_F_ACK`) in one
    /// datagram and collects, per request, its errno (0 for success, positive) and the entry
    /// it returned. A request answers with its entry or an error; a NOOP with `NLM_F_ACK`
    /// sent last is acknowledged after all of them (the kernel handles a datagram's messages
    /// in order), which tells when the batch is complete.
    fn batch(
        &mut self,
        n: usize,
        mut build: impl FnMut(&mut Vec<u8>, usize, u32),
    ) -> Result<Vec<(i32, Option<Entry>)>, Error> {
        let first = self.seq.wrapping_add(1);
        let mut out = Vec::with_capacity(n * 96 + 16);
        for i in 0..n {
            let seq = self.next_seq();
            build(&mut out, i, seq);
        }
        let marker = self.next_seq();
        push_noop_ack(&mut out, marker);
        self.socket.send(&out, 0).map_err(Error::Send)?;
        let index = |seq: u32| {
            let i = seq.wrapping_sub(first) as usize;
            (i < n).then_some(i)
        };
        let mut answers = vec![(0, None); n];
        loop {
            for reply in self.recv()? {
                match reply {
                    Reply::Entry { seq, entry } => {
                        if let Some(i) = index(seq) {
                            answers[i].1 = Some(entry);
                        }
                    }
                    Reply::Status { seq, .. } if seq == marker => return Ok(answers),
                    Reply::Status { seq, errno } => {
                        if let Some(i) = index(seq) {
                            answers[i].0 = -errno;
                        }
                    }
                    Reply::Skipped { .. } | Reply::Done { .. } => {}
                }
            }
        }
    }

    fn recv(&mut self) -> Result<Vec<Reply>, Error> {
        let n = self
            .socket
            .recv(&mut &mut self.buf[..], 0)
            .map_err(Error::Recv)?;
        decode(&self.buf[..n])
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }
}

/// Appends an `NLMSG_NOOP` asking for an acknowledgement.
fn push_noop_ack(out: &mut Vec<u8>, seq: u32) {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_ACK;
    header.sequence_number = seq;
    let mut msg = NetlinkMessage::<NetfilterMessage>::new(header, NetlinkPayload::Noop);
    msg.finalize();
    let start = out.len();
    out.resize(start + msg.buffer_len(), 0);
    msg.serialize(&mut out[start..]);
}

/// Appends one ctnetlink message to `out`.
fn push_message(
    out: &mut Vec<u8>,
    flags: u16,
    seq: u32,
    family: NetfilterProtoFamily,
    message: ConntrackMessage,
) {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = seq;
    let mut msg = NetlinkMessage::new(
        header,
        NetlinkPayload::from(NetfilterMessage::new(
            NetfilterHeader::new(family, 0, 0),
            message,
        )),
    );
    msg.finalize();
    let start = out.len();
    out.resize(start + msg.buffer_len(), 0);
    msg.serialize(&mut out[start..]);
}

/// The TCP conntrack entries of one dump: original (source, destination) -> reply source.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NatTable {
    by_original: HashMap<(SocketAddr, SocketAddr), SocketAddr>,
}

impl NatTable {
    /// A table of the given entries.
    #[must_use]
    pub fn from_entries(entries: impl IntoIterator<Item = Entry>) -> Self {
        Self {
            by_original: entries
                .into_iter()
                .map(|e| ((e.src, e.dst), e.reply_src))
                .collect(),
        }
    }

    /// The reply tuple's source for the connection whose original tuple is `src -> dst`:
    /// the backend when `dst` was DNATed.
    #[must_use]
    pub fn reply_source(&self, src: SocketAddr, dst: SocketAddr) -> Option<SocketAddr> {
        self.by_original.get(&(src, dst)).copied()
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.by_original.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.by_original.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(src: &str, dst: &str, reply_src: &str) -> Entry {
        Entry {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            reply_src: reply_src.parse().unwrap(),
        }
    }

    /// What the kernel sends for a GET or in a dump: the entry as a `New` message.
    fn wire(seq: u32, e: Entry, proto: Protocol) -> Vec<u8> {
        let mut out = Vec::new();
        let with_proto = |mut t: Vec<Tuple>| {
            if let Tuple::Proto(p) = &mut t[1] {
                p[0] = ProtoTuple::Protocol(proto);
            }
            t
        };
        push_message(
            &mut out,
            0,
            seq,
            family(e.src),
            ConntrackMessage::New(vec![
                ConntrackAttribute::CtaTupleOrig(with_proto(tuple_attrs(e.src, e.dst))),
                ConntrackAttribute::CtaTupleReply(with_proto(tuple_attrs(e.reply_src, e.src))),
                ConntrackAttribute::CtaTimeout(117),
                ConntrackAttribute::CtaMark(0),
            ]),
        );
        out
    }

    fn status(seq: u32, errno: i32) -> Vec<u8> {
        let mut header = NetlinkHeader::default();
        header.sequence_number = seq;
        let mut e = netlink_packet_core::ErrorMessage::default();
        e.code = std::num::NonZeroI32::new(errno);
        e.header = vec![0; 16];
        let mut msg = NetlinkMessage::<NetfilterMessage>::new(header, NetlinkPayload::Error(e));
        msg.finalize();
        let mut out = vec![0; msg.buffer_len()];
        msg.serialize(&mut out);
        out
    }

    #[test]
    fn decodes_entries_of_both_families_statuses_and_skips_other_protocols() {
        let v4 = entry("198.18.1.2:40000", "198.19.0.10:8080", "198.18.3.2:8080");
        let v6 = entry(
            "[fd00:198:18:1::2]:40000",
            "[fd00:198:19::c613:a]:8080",
            "[fd00:198:18:3::2]:8080",
        );
        let mut datagram = wire(7, v4, Protocol::Tcp);
        datagram.extend(wire(8, v6, Protocol::Tcp));
        datagram.extend(wire(9, v4, Protocol::Udp));
        datagram.extend(status(9, -ENOENT));
        datagram.extend(status(10, 0));
        let got = decode(&datagram).expect("a well-formed datagram decodes");
        assert_eq!(
            got,
            [
                Reply::Entry { seq: 7, entry: v4 },
                Reply::Entry { seq: 8, entry: v6 },
                Reply::Skipped { seq: 9 },
                Reply::Status {
                    seq: 9,
                    errno: -ENOENT
                },
                Reply::Status { seq: 10, errno: 0 },
            ]
        );
    }

    #[test]
    fn messages_of_other_netfilter_subsystems_are_skipped_unparsed() {
        // Found by the fuzz target: an nftables message (subsystem 10) whose attribute
        // declares a length under 4 made the netfilter crate's parser panic.
        let crash: [u8; 50] = [
            0x29, 0x00, 0x00, 0x00, 0x09, 0x0a, 0x00, 0xf7, 0x00, 0xc7, 0x00, 0x00, 0x00, 0x00,
            0x02, 0x00, 0x00, 0x10, 0x00, 0x00, 0x15, 0x00, 0x11, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x25, 0x03, 0x00, 0x00, 0x00, 0x00, 0x03, 0x00, 0xff, 0x14, 0x00, 0x01, 0x00,
            0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x80, 0x00,
        ];
        assert_eq!(
            decode(&crash).expect("a foreign message is skipped, not an error"),
            [Reply::Skipped { seq: 0xc700 }]
        );
    }

    #[test]
    fn impossible_lengths_are_errors_not_reads_past_the_end() {
        let mut datagram = wire(
            1,
            entry("10.0.0.1:1", "10.0.0.2:2", "10.0.0.3:2"),
            Protocol::Tcp,
        );
        let real = datagram.len();
        datagram[..4].copy_from_slice(&u32::try_from(real + 4).unwrap().to_ne_bytes());
        assert!(
            matches!(decode(&datagram), Err(Error::Length { declared, .. }) if declared == real + 4),
            "a length past the datagram must be refused"
        );
        datagram[..4].copy_from_slice(&8u32.to_ne_bytes());
        assert!(
            matches!(decode(&datagram), Err(Error::Length { declared: 8, .. })),
            "a length shorter than a header must be refused"
        );
        // A nested attribute claiming more than its parent holds.
        let mut datagram = wire(
            1,
            entry("10.0.0.1:1", "10.0.0.2:2", "10.0.0.3:2"),
            Protocol::Tcp,
        );
        // nlmsghdr (16) + nfgenmsg (4) -> CTA_TUPLE_ORIG's nla_len.
        datagram[20..22].copy_from_slice(&500u16.to_ne_bytes());
        assert!(
            decode(&datagram).is_err(),
            "an attribute longer than its message must be refused"
        );
    }

    #[test]
    fn the_join_key_is_the_exact_tuple() {
        let t = NatTable::from_entries([entry(
            "198.18.1.2:40000",
            "198.19.0.10:8080",
            "198.18.3.2:8080",
        )]);
        // Same client port, other VIP port: not the same connection.
        assert_eq!(
            t.reply_source(
                "198.18.1.2:40000".parse().unwrap(),
                "198.19.0.10:9090".parse().unwrap()
            ),
            None
        );
    }
}
